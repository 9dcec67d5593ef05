"""Envoy's ext_proc messages in Python: xds-protos (protobuf, upb) against envoy-data-plane.

Why policyd reads and writes ext_proc with ``xds-protos`` rather than the
``envoy-data-plane`` package (betterproto2 dataclasses of the same protos).
For the messages of one routed request, as Envoy 1.40 sends them to policyd
(the request headers with the protocol configuration, then the BUFFERED
OpenAI body) and the routing reply policyd sends back (destination header,
``envoy.lb`` metadata, route cache cleared), it prints the median time to
parse the two requests and to build and serialize the reply, with each
package, checking first that both read the same headers and body and that
each one's reply bytes parse to the same message under the other. Also the
import time of each package's ext_proc module, in a fresh interpreter.

envoy-data-plane is not a dependency of policyd: run this in a scratch venv
holding both packages (the versions policyd uses for the rest)::

    python3.11 -m venv /tmp/venv-edp
    /tmp/venv-edp/bin/pip install envoy-data-plane xds-protos==1.85.0
    /tmp/venv-edp/bin/python benchmarks/envoy_protos.py      # about 10 s

Under the project's venv it says envoy-data-plane is missing and stops.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import timeit
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

ENDPOINT = "10.0.0.12:8000"
HEADERS = {
    ":authority": "gateway.example:8081",
    ":path": "/v1/completions",
    ":method": "POST",
    ":scheme": "http",
    "user-agent": "python-requests/2.32.3",
    "accept-encoding": "gzip, deflate",
    "accept": "*/*",
    "content-type": "application/json",
    "content-length": "178",
    "x-forwarded-proto": "http",
    "x-request-id": "7f1a3c2e-5b4d-4f6e-9a8b-0c1d2e3f4a5b",
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
}
BODY = json.dumps(
    {
        "model": "adapter-3",
        "prompt": "Write as if you were a critic: San Francisco",
        "max_tokens": 750,
        "temperature": 0,
        "stream": False,
    }
).encode()


def upb_messages() -> tuple[bytes, bytes, Callable[[], bytes]]:
    """Wire bytes of the two requests, and a function building and serializing the reply."""
    mode = processing_mode_pb2.ProcessingMode
    headers = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in HEADERS.items()
                ]
            )
        ),
        protocol_config=pb.ProtocolConfiguration(
            request_body_mode=mode.BUFFERED, response_body_mode=mode.STREAMED
        ),
    )
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))

    def reply() -> bytes:
        metadata = struct_pb2.Struct()
        metadata.fields["envoy.lb"].struct_value.fields[
            "x-gateway-destination-endpoint"
        ].string_value = ENDPOINT
        return pb.ProcessingResponse(
            request_body=pb.BodyResponse(
                response=pb.CommonResponse(
                    header_mutation=pb.HeaderMutation(
                        set_headers=[
                            base_pb2.HeaderValueOption(
                                header=base_pb2.HeaderValue(
                                    key="x-gateway-destination-endpoint",
                                    raw_value=ENDPOINT.encode(),
                                ),
                                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                            )
                        ]
                    ),
                    clear_route_cache=True,
                )
            ),
            dynamic_metadata=metadata,
        ).SerializeToString()

    return headers.SerializeToString(), body.SerializeToString(), reply


def upb_parse(headers: bytes, body: bytes) -> tuple[dict[str, bytes], bytes]:
    first = pb.ProcessingRequest.FromString(headers)
    second = pb.ProcessingRequest.FromString(body)
    got = {h.key: h.raw_value for h in first.request_headers.headers.headers}
    return got, second.request_body.body


def edp_functions() -> tuple[Callable[[bytes, bytes], Any], Callable[[], bytes]]:
    from envoy_data_plane.envoy.config.core import v3 as core
    from envoy_data_plane.envoy.service.ext_proc import v3 as ext_proc
    from envoy_data_plane.google import protobuf

    def parse(headers: bytes, body: bytes) -> tuple[dict[str, bytes], bytes]:
        first = ext_proc.ProcessingRequest.parse(headers)
        second = ext_proc.ProcessingRequest.parse(body)
        assert first.request_headers is not None and first.request_headers.headers is not None
        assert second.request_body is not None
        got = {h.key: h.raw_value for h in first.request_headers.headers.headers}
        return got, second.request_body.body

    def reply() -> bytes:
        inner = protobuf.Struct(
            fields={"x-gateway-destination-endpoint": protobuf.Value(string_value=ENDPOINT)}
        )
        metadata = protobuf.Struct(fields={"envoy.lb": protobuf.Value(struct_value=inner)})
        return bytes(
            ext_proc.ProcessingResponse(
                request_body=ext_proc.BodyResponse(
                    response=ext_proc.CommonResponse(
                        header_mutation=ext_proc.HeaderMutation(
                            set_headers=[
                                core.HeaderValueOption(
                                    header=core.HeaderValue(
                                        key="x-gateway-destination-endpoint",
                                        raw_value=ENDPOINT.encode(),
                                    ),
                                    append_action=core.HeaderValueOptionHeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD,
                                )
                            ]
                        ),
                        clear_route_cache=True,
                    )
                ),
                dynamic_metadata=metadata,
            )
        )

    return parse, reply


def median_us(function: Callable[[], object], number: int) -> float:
    runs = timeit.repeat(function, number=number, repeat=7)
    return statistics.median(runs) / number * 1e6


def import_ms(module: str) -> float:
    """Median wall time of ``import module`` in a fresh interpreter, over 5 runs."""
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    times = [
        float(
            subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, check=True
            ).stdout
        )
        for _ in range(5)
    ]
    return statistics.median(times) * 1e3


def main() -> None:
    try:
        edp_version = version("envoy-data-plane")
    except PackageNotFoundError:
        print(
            "envoy-data-plane is not installed here (it is not a dependency of policyd); "
            "see this script's docstring for the scratch venv to run it in"
        )
        return
    headers, body, upb_reply = upb_messages()
    edp_parse, edp_reply = edp_functions()

    # Both read the same thing, and each reply means the same to the other.
    assert (
        upb_parse(headers, body)
        == edp_parse(headers, body)
        == (
            {k: v.encode() for k, v in HEADERS.items()},
            BODY,
        )
    )
    assert pb.ProcessingResponse.FromString(edp_reply()) == pb.ProcessingResponse.FromString(
        upb_reply()
    )
    from envoy_data_plane.envoy.service.ext_proc import v3 as ext_proc

    assert ext_proc.ProcessingResponse.parse(upb_reply()) == ext_proc.ProcessingResponse.parse(
        edp_reply()
    )

    print(
        f"xds-protos {version('xds-protos')} on protobuf {version('protobuf')} "
        f"({__import__('google.protobuf.internal.api_implementation', fromlist=['x']).Type()}), "
        f"envoy-data-plane {edp_version} on betterproto2 {version('betterproto2')}; "
        f"Python {sys.version.split()[0]}"
    )
    print(
        f"messages: request headers {len(headers)} B ({len(HEADERS)} headers), "
        f"request body {len(body)} B, routing reply {len(upb_reply())} B"
    )
    rows = [
        (
            "parse headers + body",
            lambda: upb_parse(headers, body),
            lambda: edp_parse(headers, body),
        ),
        ("build + serialize reply", upb_reply, edp_reply),
    ]
    print(f"{'median us per call':<26} {'xds-protos':>11} {'envoy-data-plane':>17} {'ratio':>7}")
    for name, upb, edp in rows:
        upb_us, edp_us = median_us(upb, 20000), median_us(edp, 500)
        print(f"{name:<26} {upb_us:>11.2f} {edp_us:>17.1f} {edp_us / upb_us:>6.0f}x")
    upb_import = import_ms("envoy.service.ext_proc.v3.external_processor_pb2")
    edp_import = import_ms("envoy_data_plane.envoy.service.ext_proc.v3")
    print(
        f"{'import ext_proc module ms':<26} {upb_import:>11.0f} {edp_import:>17.0f} "
        f"{edp_import / upb_import:>6.0f}x"
    )


if __name__ == "__main__":
    main()
