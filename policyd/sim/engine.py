"""The scheduler of one simulated vLLM pod (V0 rules), independent of any clock.

The engine never sleeps and never reads a clock: a driver asks it to plan the
next step at time ``now`` (``start_step`` returns how long that step takes) and
tells it when the step is over (``finish_step``). The HTTP front drives it in
real (scaled) time, ``policyd.sim.virtual`` in a discrete-event loop; the rules
are the same code either way.

The rules, as vLLM V0 applies them without chunked prefill:

- Every step first tries to admit waiting requests in arrival order (a
  *prefill* step, which runs alone); only when none can be admitted does it run
  a *decode* step that advances every running sequence by one token.
- A request is admitted while the running set stays within ``max_num_seqs``,
  the step within ``max_num_batched_tokens`` and the KV cache keeps its
  watermark free after allocating the request's blocks; the first request that
  does not fit stops admission.
- At most ``max_loras`` distinct adapters run at once. A waiting request whose
  adapter is not running while that many are is skipped: it keeps its place and
  later requests may pass it. A new adapter therefore starts only once every
  running request of some adapter has finished. Bringing an adapter into a GPU
  slot adds its load time to the step.
- A decode step needs a fresh block for every sequence crossing a block
  boundary; when none is left the newest running sequence is preempted (its
  blocks freed, back to the front of the queue, recomputed on readmission).
- Leading full prompt blocks found in the prefix cache are not recomputed (at
  least one token always is).

Disaggregated prefill and decode (V1 profiles only, ``engine_v1``): a request
marked ``remote_decode`` is prefilled for another pod, writes one token and
keeps its blocks for the time the decode pod takes to read them; a request
carrying ``remote_prefill`` has its prompt's KV read from a prefill pod, which
takes ``Profile.kv_transfer_s`` and overlaps the steps of the other requests.
"""

from __future__ import annotations

import enum
import math
import random
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from policyd.sim.blocks import BlockManager, BlocksStored, KvEvent, prefix_keys
from policyd.sim.lora import AdapterResidence
from policyd.sim.profile import Profile
from policyd.sim.stats import LORA_SERIES_KEPT, EngineStats


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """Where a decode request's prompt KV was computed: vLLM's ``kv_transfer_params``
    with ``do_remote_prefill`` (the prefill pod's engine, its blocks, its host and port)."""

    engine_id: str
    block_ids: tuple[int, ...]
    host: str | None = None
    port: int | None = None


class RequestListener(Protocol):
    """Told after every step that produced a token for the request (or finished it)."""

    def on_progress(self, state: RequestState, now: float) -> None: ...


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One generation request as the engine receives it.

    ``output_length`` is the natural length of the text the model would write;
    ``None`` lets the engine draw it from its seeded generator
    (``Profile.natural_output_tokens``). ``max_tokens`` caps it either way;
    ``None`` (a chat request without one) caps it at the context left after
    the prompt. ``text_seed`` picks the words generated (``policyd.sim.text``),
    whose token ids a V1 pod caches with the prompt's.
    """

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int | None
    adapter: str | None = None
    output_length: int | None = None
    listener: RequestListener | None = None
    text_seed: int = 0
    # Disaggregation: prefill only, for a decode pod (vLLM's do_remote_decode) ...
    remote_decode: bool = False
    # ... or decode a prompt another pod prefilled (do_remote_prefill).
    remote_prefill: RemotePrefill | None = None


class Phase(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class RequestState:
    """The engine's view of one request; callers read it, only the engine writes it."""

    __slots__ = (
        "aborted",
        "arrival",
        "blocks",
        "cached_tokens",
        "computed",
        "finish_reason",
        "finished_at",
        "first_token_at",
        "generated",
        "keys",
        "last_token_at",
        "output_ids",
        "phase",
        "registered",
        "request",
        "sent_blocks",
        "target",
        "transfer_done_at",
    )

    def __init__(
        self, request: SimRequest, arrival: float, natural_length: int, max_tokens: int
    ) -> None:
        self.request = request
        self.arrival = arrival
        self.target = min(natural_length, max_tokens)
        self.finish_reason = "stop" if natural_length <= max_tokens else "length"
        self.generated = 0
        self.phase = Phase.WAITING
        self.first_token_at: float | None = None
        self.last_token_at = arrival
        self.finished_at: float | None = None
        self.blocks: list[int] = []
        self.cached_tokens = 0
        self.keys: tuple[int, ...] | None = None
        self.aborted = False
        # V1 only: tokens whose KV is computed, the generated token ids, and
        # how many leading blocks are registered in the prefix cache.
        self.computed = 0
        self.output_ids: list[int] = []
        self.registered = 0
        # Disaggregation: the blocks a remote_decode request leaves for its
        # decode pod, and when a remote_prefill request's KV has arrived.
        self.sent_blocks: tuple[int, ...] = ()
        self.transfer_done_at: float | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what a recompute has to prefill."""
        return len(self.request.prompt) + self.generated

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Token ids ``start`` up to ``stop`` of the prompt followed by the generated ids."""
        prompt = self.request.prompt
        return [
            *prompt[start:stop],
            *self.output_ids[max(start - len(prompt), 0) : max(stop - len(prompt), 0)],
        ]


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The scheduler state vLLM logs after each step (what ``/metrics`` shows)."""

    at: float
    waiting: int
    running: int
    kv_cache_usage: float
    running_adapters: tuple[str, ...]
    waiting_adapters: tuple[str, ...]
    max_loras: int
    preemptions: int = 0  # since the engine started (vllm:num_preemptions_total)


@dataclass(frozen=True, slots=True)
class Step:
    """The step running: its sequences and, under V1, how many tokens each computes."""

    prefill: bool
    batch: list[RequestState]
    tokens: tuple[int, ...] = ()


def _distinct_adapters(states: Iterable[RequestState]) -> tuple[str, ...]:
    """Adapter names in order of first appearance, as vLLM joins them into a label."""
    names = dict.fromkeys(s.request.adapter for s in states if s.request.adapter is not None)
    return tuple(names)


class Engine:
    """Continuous batching for one pod: queues, KV blocks, adapters, statistics."""

    def __init__(self, profile: Profile, *, seed: int = 0) -> None:
        self.profile = profile
        self.stats = EngineStats()
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self._blocks = BlockManager(
            profile.num_gpu_blocks, int(profile.watermark * profile.num_gpu_blocks)
        )
        self._adapters = AdapterResidence(profile)
        self._rng = random.Random(seed)
        self._step: Step | None = None
        self._snapshot = EngineSnapshot(0.0, 0, 0, 0.0, (), (), profile.max_loras)
        # Bumped by every change of who waits or runs: the snapshot's adapter
        # lists and a fruitless admission scan stay valid while it is unchanged.
        self._membership = 0
        self._logged_membership = 0
        self._fruitless_scan = -1
        # Disaggregation: decode requests whose prompt KV is arriving (they
        # hold their blocks and count as waiting, as vLLM's WAITING_FOR_REMOTE_KVS
        # do), and blocks a prefill pod keeps until its decode pod has read them.
        self.transferring: list[RequestState] = []
        self._held: list[tuple[float, list[int]]] = []

    # -- requests ---------------------------------------------------------------------------

    def add(self, request: SimRequest, now: float) -> RequestState:
        """Queue a request arriving at ``now``; ``ValueError`` if it can never run here."""
        max_tokens = self.check(request)
        natural = request.output_length
        if natural is None:
            natural = self.profile.natural_output_tokens(self._rng, request.max_tokens)
        state = RequestState(request, now, natural, max_tokens)
        if request.remote_decode:
            # The sidecar caps a prefill at one token; vLLM hands the blocks
            # over only to a request that stopped at its length cap.
            state.target, state.finish_reason = 1, "length"
        self.waiting.append(state)
        self._membership += 1
        return state

    def check(self, request: SimRequest) -> int:
        """The request's effective ``max_tokens``; ``ValueError`` with a client-facing
        message if the request cannot run."""
        profile = self.profile
        max_tokens = request.max_tokens
        if max_tokens is None:
            max_tokens = max(profile.max_model_len - len(request.prompt), 1)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        if not request.prompt:
            raise ValueError("the prompt is empty")
        if request.remote_decode and request.remote_prefill is not None:
            raise ValueError("kv_transfer_params ask for a remote prefill and decode at once")
        if (request.remote_decode or request.remote_prefill) and profile.scheduler != "v1":
            raise ValueError(f"profile {profile.name} has no KV connector (P/D needs vLLM V1)")
        total = len(request.prompt) + max_tokens
        if total > profile.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {profile.max_model_len} tokens. "
                f"However, you requested {total} tokens ({len(request.prompt)} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length "
                "of the messages or completion."
            )
        usable = profile.num_gpu_blocks - int(profile.watermark * profile.num_gpu_blocks)
        if math.ceil(total / profile.block_size) > usable:
            raise ValueError(f"{total} tokens do not fit in this pod's KV cache")
        return max_tokens

    def abort(self, state: RequestState) -> None:
        """Forget a request whose client went away; its blocks are freed at once or at step end."""
        if state.phase is Phase.FINISHED or state.aborted:
            return
        state.aborted = True
        state.finish_reason = "abort"
        self._membership += 1
        if state in self.transferring:  # nobody waits for its KV any more
            self.transferring.remove(state)
            self._release(state)
            state.phase = Phase.FINISHED
        elif state.phase is Phase.WAITING:
            self.waiting.remove(state)
            state.phase = Phase.FINISHED
        elif self._step is None or state not in self._step.batch:
            self.running.remove(state)
            self._release(state)
            state.phase = Phase.FINISHED

    # -- KV events ----------------------------------------------------------------------------

    def record_kv_events(self) -> None:
        """Start noting blocks stored, evicted and cleared (off by default: no cost)."""
        if self._blocks.record is None:
            self._blocks.record = []

    def take_kv_events(self) -> list[KvEvent]:
        """The KV events since the last call, oldest first (empty unless recording)."""
        events = self._blocks.record
        if not events:
            return []
        self._blocks.record = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block if none is in use (vLLM's ``reset_prefix_cache``)."""
        return self._blocks.reset_prefix_cache()

    # -- stepping ---------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.transferring or self._held)

    def next_due(self) -> float | None:
        """When the next KV transfer ends or held blocks are let go (``None``: none is
        pending): an engine with nothing to step must be woken by then."""
        times = [s.transfer_done_at for s in self.transferring if s.transfer_done_at is not None]
        times += [at for at, _ in self._held]
        return min(times, default=None)

    def _settle_transfers(self, now: float) -> None:
        """Let go of blocks read by now (``EngineV1``, the P/D engine, also lands transfers)."""
        if self._held:
            due = [blocks for at, blocks in self._held if at <= now]
            if due:
                self._held = [(at, blocks) for at, blocks in self._held if at > now]
                for blocks in due:
                    self._blocks.free(blocks)
                self._membership += 1

    def start_step(self, now: float) -> float | None:
        """Plan the step starting at ``now``; its duration, or ``None`` when idle."""
        if self._step is not None:
            raise RuntimeError("start_step called while a step is running")
        admitted, cost = self._schedule_prefills()
        if admitted:
            computed = sum(s.num_tokens - s.cached_tokens for s in admitted)
            duration = self.profile.prefill_step_s(computed) + cost
            self._step = Step(True, admitted)
            return duration
        if not self.running:
            return None
        batch = self._schedule_decodes()
        if not batch:  # everything was preempted; the next plan readmits it
            return self.start_step(now)
        duration = self.profile.decode_step_s(len(batch))
        self._step = Step(False, batch)
        return duration

    def finish_step(self, now: float) -> None:
        """Apply the planned step's results at ``now`` (its end) and tell the listeners."""
        step = self._step
        if step is None:
            raise RuntimeError("finish_step called with no step running")
        self._step = None
        progressed: list[RequestState] = []
        for state in step.batch:
            if state.aborted:
                self._release(state)
                state.phase = Phase.FINISHED
                continue
            if step.prefill:
                self._register_prefix(state)
                if state.first_token_at is None:
                    self.stats.prompt_tokens += len(state.request.prompt)
            self._emit_token(state, now)
            progressed.append(state)
        if any(s.finished for s in step.batch):
            self.running = [s for s in self.running if not s.finished]
        self._log_state(now)
        for state in progressed:
            listener = state.request.listener
            if listener is not None:
                listener.on_progress(state, now)

    def snapshot(self) -> EngineSnapshot:
        """The state as logged at the end of the last step (or by ``log_stats``)."""
        return self._snapshot

    def log_stats(self, now: float) -> None:
        """Log the state at ``now`` the way vLLM's periodic stats logging does.

        vLLM's API server logs the engine's stats every
        ``VLLM_LOG_STATS_INTERVAL`` seconds, busy or idle: that is when an idle
        pod, one that has never served, sets its first
        ``vllm:lora_requests_info`` series (empty adapter lists, ``max_lora``).
        A busy engine logs after every step anyway, so only an idle one (no
        step running, nothing waiting or running) logs here: no step can then
        end at an earlier time than this log.
        """
        if self._step is None and not self.has_work:
            self._log_state(now)

    # -- scheduling ---------------------------------------------------------------------------

    def _schedule_prefills(self) -> tuple[list[RequestState], float]:
        if self._fruitless_scan == self._membership:
            # Nobody arrived, finished or left since a scan that admitted nothing,
            # and running sequences only take blocks: it would admit nothing again.
            return [], 0.0
        profile = self.profile
        running_adapters = {
            s.request.adapter for s in self.running if s.request.adapter is not None
        }
        active = set(running_adapters)
        admitted: list[RequestState] = []
        skipped: list[RequestState] = []
        tokens = 0
        seqs = len(self.running)
        while self.waiting:
            state = self.waiting[0]
            blocks = math.ceil(state.num_tokens / profile.block_size)
            if not self._blocks.can_allocate(blocks):
                break
            adapter = state.request.adapter
            if adapter is not None and adapter not in active and len(active) >= profile.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if (
                tokens + state.num_tokens > profile.max_num_batched_tokens
                or seqs + 1 > profile.max_num_seqs
            ):
                break
            self.waiting.popleft()
            self._allocate(state, blocks)
            if adapter is not None:
                active.add(adapter)
            admitted.append(state)
            tokens += state.num_tokens
            seqs += 1
        self.waiting.extendleft(reversed(skipped))
        if not admitted:
            self._fruitless_scan = self._membership
            return admitted, 0.0
        self.running.extend(admitted)
        self._membership += 1
        new_adapters = dict.fromkeys(
            s.request.adapter for s in admitted if s.request.adapter is not None
        )
        cost = self._adapters.activate(running_adapters, new_adapters)
        return admitted, cost

    def _allocate(self, state: RequestState, blocks: int) -> None:
        profile = self.profile
        if state.keys is None:
            state.keys = (
                prefix_keys(
                    state.request.adapter or profile.base_model,
                    state.request.prompt,
                    profile.block_size,
                )
                if profile.enable_prefix_caching
                else ()
            )
        state.blocks, hits = self._blocks.allocate(state.keys, blocks)
        state.cached_tokens = min(hits * profile.block_size, state.num_tokens - 1)
        state.phase = Phase.RUNNING
        self.stats.prefix_cache_queries += state.num_tokens
        self.stats.prefix_cache_hits += state.cached_tokens

    def _schedule_decodes(self) -> list[RequestState]:
        block_size = self.profile.block_size
        # A decode adds one token, so a sequence needs at most one more block.
        growing = [s for s in self.running if s.num_tokens > len(s.blocks) * block_size]
        if self._blocks.can_append(len(growing)):  # the usual case: no preemption
            for state in growing:
                state.blocks.append(self._blocks.take_fresh())
            return list(self.running)
        queue = deque(self.running)
        batch: list[RequestState] = []
        preempted: list[RequestState] = []
        while queue:
            state = queue.popleft()
            needed = math.ceil(state.num_tokens / block_size) - len(state.blocks)
            while needed > 0 and not self._blocks.can_append(needed):
                victim = queue.pop() if queue else state
                self._preempt(victim)
                preempted.append(victim)
                if victim is state:
                    break
            else:
                for _ in range(needed):
                    state.blocks.append(self._blocks.take_fresh())
                batch.append(state)
        self.running = batch
        self.waiting.extendleft(preempted)
        return batch

    def _preempt(self, state: RequestState) -> None:
        self._release(state)
        state.phase = Phase.WAITING
        self.stats.preemptions += 1
        self._membership += 1

    def _release(self, state: RequestState) -> None:
        self._blocks.free(state.blocks)
        state.blocks = []

    def _register_prefix(self, state: RequestState) -> None:
        keys = state.keys or ()
        blocks = self._blocks
        if blocks.record is None:
            for block, key in zip(state.blocks, keys, strict=False):
                blocks.register(block, key)
            return
        # Each run of newly cached blocks is one BlockStored, chained to the block before it.
        run: list[int] = []
        for index, (block, key) in enumerate(zip(state.blocks, keys, strict=False)):
            if blocks.register(block, key):
                run.append(index)
                continue
            self._record_stored(state, run)
            run = []
        self._record_stored(state, run)

    def _record_stored(self, state: RequestState, run: list[int]) -> None:
        if not run or self._blocks.record is None:
            return
        keys = state.keys or ()
        size = self.profile.block_size
        first, last = run[0], run[-1]
        self._blocks.record.append(
            BlocksStored(
                tuple(keys[first : last + 1]),
                keys[first - 1] if first else None,
                tuple(state.token_ids(first * size, (last + 1) * size)),
                state.request.adapter,
            )
        )

    def _emit_token(self, state: RequestState, now: float) -> None:
        stats = self.stats
        state.generated += 1
        stats.generation_tokens += 1
        if state.first_token_at is None:
            state.first_token_at = now
            stats.time_to_first_token.observe(now - state.arrival)
        else:
            stats.time_per_output_token.observe(now - state.last_token_at)
        state.last_token_at = now
        if state.generated >= state.target:
            if state.request.remote_decode:
                self._hold_for_decode(state, now)
            else:
                self._release(state)
            state.phase = Phase.FINISHED
            state.finished_at = now
            reason = state.finish_reason
            stats.finished[reason] = stats.finished.get(reason, 0) + 1
            stats.e2e_request_latency.observe(now - state.arrival)
            self._membership += 1

    def _hold_for_decode(self, state: RequestState, now: float) -> None:
        """Keep a finished prefill's prompt blocks until its decode pod has read them.

        The decode pod reads them as soon as the answer reaches it, which takes
        the same transfer time there; vLLM frees them when the reader says so.
        """
        prompt = len(state.request.prompt)
        kept = state.blocks[: math.ceil(prompt / self.profile.block_size)]
        self._blocks.free(state.blocks[len(kept) :])
        state.sent_blocks = tuple(kept)
        state.blocks = []
        if kept:
            self._held.append((now + self.profile.kv_transfer_s(prompt), kept))

    def _log_state(self, now: float) -> None:
        """Refresh the snapshot the way vLLM logs its stats after every step."""
        previous = self._snapshot
        if self._membership != self._logged_membership:
            running = _distinct_adapters(self.running)
            waiting = _distinct_adapters(self.waiting)
            self._logged_membership = self._membership
        else:
            running, waiting = previous.running_adapters, previous.waiting_adapters
        self._snapshot = EngineSnapshot(
            now,
            len(self.waiting) + len(self.transferring),
            len(self.running),
            self._blocks.usage,
            running,
            waiting,
            self.profile.max_loras,
            self.stats.preemptions,
        )
        series = self.stats.lora_series
        key = (",".join(running), ",".join(waiting))
        series.pop(key, None)
        series[key] = now
        if len(series) > LORA_SERIES_KEPT:
            del series[next(iter(series))]
