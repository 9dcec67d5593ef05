"""Loopback HTTP servers standing in for model-server pods.

A real vLLM pod needs a GPU, so the pool's tests run these instead: real
aiohttp servers on 127.0.0.1 that serve ``/metrics`` in the exposition format
a vLLM server prints (``VLLM_SAMPLE`` is that format verbatim), and that can
be told to hang or to go away like a sick pod.
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

VLLM_SAMPLE = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-2-7b-hf"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-2-7b-hf"} 0.0
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.1234
vllm:kv_cache_usage_perc{model_name="meta-llama/Llama-2-7b-hf"} 0.1234
vllm:lora_requests_info{max_lora="4",running_lora_adapters="adapter-1,adapter-3",waiting_lora_adapters=""} 1.7327e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="adapter-1",waiting_lora_adapters="adapter-3"} 1.7327e+09
"""  # noqa: E501 - the lines exactly as vLLM prints them


def vllm_text(
    *,
    waiting: float = 0,
    running: float = 0,
    kv_cache: float = 0.0,
    running_loras: str = "",
    waiting_loras: str = "",
    max_lora: int = 4,
) -> str:
    """A vLLM exposition with the given gauges and one current LoRA series."""
    model = 'model_name="meta-llama/Llama-2-7b-hf"'
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f"vllm:num_requests_running{{{model}}} {float(running)}\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        f"vllm:num_requests_waiting{{{model}}} {float(waiting)}\n"
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f"vllm:kv_cache_usage_perc{{{model}}} {kv_cache}\n"
        "# TYPE vllm:lora_requests_info gauge\n"
        f'vllm:lora_requests_info{{max_lora="{max_lora}",'
        f'running_lora_adapters="{running_loras}",waiting_lora_adapters="{waiting_loras}"}} '
        f"{time.time()}\n"
    )


class MetricsServer:
    """One stand-in pod: answers ``GET path`` with ``text`` until told otherwise."""

    def __init__(self, text: str = VLLM_SAMPLE, path: str = "/metrics") -> None:
        self.text = text
        self.path = path
        self.status = 200
        self.requests = 0
        self.last_answer_at: float | None = None  # event-loop time of the last answer
        self._hanging = False
        self._released = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self.address = ""

    async def start(self, port: int = 0) -> str:
        app = web.Application()
        app.router.add_get(self.path, self._metrics)
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        assert site._server is not None
        bound_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.address = f"127.0.0.1:{bound_port}"
        return self.address

    def hang(self) -> None:
        """From now on, accept requests and never answer them."""
        self._hanging = True

    async def stop(self) -> None:
        """Go away: close the port and every connection."""
        self._released.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.Response:
        self.requests += 1
        if self._hanging:
            await self._released.wait()
        self.last_answer_at = asyncio.get_running_loop().time()
        return web.Response(text=self.text, status=self.status, content_type="text/plain")
