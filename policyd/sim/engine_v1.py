"""The scheduler of one simulated vLLM pod under V1's rules (chunked prefill, one token budget).

``EngineV1`` keeps the V0 engine's requests, KV blocks, adapters and statistics
and replaces how a step is planned and applied, as vLLM V1's scheduler does:

- Every step is one batch under a budget of ``max_num_batched_tokens`` tokens.
  Running requests come first, in the order they were admitted: a decoding
  request computes one token, a partly prefilled one the rest of its prompt up
  to what is left of the budget. Then, if nothing was preempted, waiting
  requests are admitted in arrival order while the budget, ``max_num_seqs``
  and the KV cache allow; the last one admitted may get only a chunk of its
  prompt and continues in the next steps. A long prompt therefore never stalls
  the decodes already running.
- A request needs blocks only for the tokens computed so far (no watermark).
  When a running request cannot get one, the newest running request is
  preempted (recompute: its blocks are freed, it goes back to the front of the
  queue); if that is the request itself, the step stops scheduling.
- At most ``max_loras`` distinct adapters in a batch; a waiting request whose
  adapter would exceed them is skipped (keeps its place, later ones may pass).
- Prefix caching hashes every full block of a request's tokens, the prompt and
  the generated ones alike, chained from the model or adapter name; a block
  enters the cache as soon as its KV is computed, so a request admitted later
  (a follow-up resending the conversation, or the preempted request itself)
  skips it. At least one token is always computed: the look-up stops one
  token short of the request's length.
- A request yields a token at the end of the step that computed its last
  token; a prefill chunk that leaves tokens uncomputed yields none.
- A request with ``remote_prefill`` is admitted, in its turn, for its KV
  alone: it takes the blocks of its whole prompt and no step budget, and
  waits (counted as waiting) for ``Profile.kv_transfer_s`` of the prompt
  tokens its own prefix cache lacks, as vLLM's NixlConnector reads only
  those. Steps go on meanwhile. Once the KV has arrived every prompt token
  but the last counts as computed and cached (announced as ``BlockStored``),
  and the request joins the running ones: the next step computes the last
  prompt token and yields the first token. A preempted one recomputes locally.

The step costs ``Profile.step_s(prefill tokens, decode sequences, context
tokens)`` plus adapter loads: decodes are sequences computing their one newest
token, every other scheduled token is a prefill token, and the context is the
KV already cached for the scheduled sequences, which attention reads.
"""

from __future__ import annotations

import math

from policyd.sim.engine import Engine, Phase, RequestState, Step
from policyd.sim.profile import Profile
from policyd.sim.text import token_id
from policyd.sim.tokenizer import chain_hash, root_hash


def new_engine(profile: Profile, *, seed: int = 0) -> Engine:
    """The engine that runs ``profile``'s scheduler."""
    if profile.scheduler == "v1":
        return EngineV1(profile, seed=seed)
    return Engine(profile, seed=seed)


class EngineV1(Engine):
    """Continuous batching with chunked prefill under one token budget per step."""

    def start_step(self, now: float) -> float | None:
        """Plan the step starting at ``now``; its duration, or ``None`` when idle."""
        if self._step is not None:
            raise RuntimeError("start_step called while a step is running")
        self._settle_transfers(now)
        while True:
            planned, preempted = self._schedule_running()
            if preempted and not planned and self.waiting:
                continue  # everything running was preempted: plan again, readmitting
            break
        running_adapters = dict.fromkeys(
            s.request.adapter for s, _ in planned if s.request.adapter is not None
        )
        admitted: list[tuple[RequestState, int]] = []
        if not preempted:
            admitted = self._admit(sum(n for _, n in planned), set(running_adapters), now)
        batch = planned + admitted
        if not batch:
            return None
        new_adapters = dict.fromkeys(
            s.request.adapter
            for s, _ in admitted
            if s.request.adapter is not None and s.request.adapter not in running_adapters
        )
        load = self._adapters.activate(running_adapters, new_adapters)
        prefill = decodes = context = 0
        for state, tokens in batch:
            context += state.computed
            if tokens == 1 and state.generated and state.computed == state.num_tokens - 1:
                decodes += 1
            else:
                prefill += tokens
        self._step = Step(bool(admitted), [s for s, _ in batch], tuple(n for _, n in batch))
        return self.profile.step_s(prefill, decodes, context) + load

    def finish_step(self, now: float) -> None:
        """Apply the planned step's results at ``now`` (its end) and tell the listeners."""
        step = self._step
        if step is None:
            raise RuntimeError("finish_step called with no step running")
        self._step = None
        progressed: list[RequestState] = []
        for state, tokens in zip(step.batch, step.tokens, strict=True):
            if state.aborted:
                self._release(state)
                state.phase = Phase.FINISHED
                continue
            state.computed += tokens
            self._cache_full_blocks(state)
            if state.computed < state.num_tokens:
                continue  # a prefill chunk: no token yet
            if state.first_token_at is None:
                self.stats.prompt_tokens += len(state.request.prompt)
            state.output_ids.append(token_id(state.request.text_seed, state.generated))
            self._emit_token(state, now)
            progressed.append(state)
        if any(s.finished for s in step.batch):
            self.running = [s for s in self.running if not s.finished]
        self._log_state(now)
        for state in progressed:
            listener = state.request.listener
            if listener is not None:
                listener.on_progress(state, now)

    # -- planning --------------------------------------------------------------------------

    def _schedule_running(self) -> tuple[list[tuple[RequestState, int]], bool]:
        """Running requests in admission order within the budget, preempting the newest."""
        block_size = self.profile.block_size
        budget = self.profile.max_num_batched_tokens
        blocks = self._blocks
        planned: list[tuple[RequestState, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            state = self.running[index]
            tokens = min(state.num_tokens - state.computed, budget)
            needed = math.ceil((state.computed + tokens) / block_size) - len(state.blocks)
            stopped = False
            while needed > blocks.num_free:
                victim = self.running.pop()
                self._preempt_v1(victim)
                preempted = True
                if victim is state:
                    stopped = True
                    break
            if stopped:
                break
            for _ in range(needed):
                state.blocks.append(blocks.take_fresh())
            planned.append((state, tokens))
            budget -= tokens
            index += 1
        return planned, preempted

    def _admit(self, used: int, adapters: set[str], now: float) -> list[tuple[RequestState, int]]:
        """Waiting requests in arrival order, the last one possibly as a first chunk."""
        profile = self.profile
        block_size = profile.block_size
        budget = profile.max_num_batched_tokens - used
        admitted: list[tuple[RequestState, int]] = []
        skipped: list[RequestState] = []
        while self.waiting and budget > 0 and len(self.running) < profile.max_num_seqs:
            state = self.waiting[0]
            adapter = state.request.adapter
            if (
                adapter is not None
                and adapter not in adapters
                and len(adapters) >= profile.max_loras
            ):
                skipped.append(self.waiting.popleft())
                continue
            keys = self._block_keys(state, (state.num_tokens - 1) // block_size)
            hit_keys = keys[: self._blocks.cached_run(keys)]
            computed = len(hit_keys) * block_size
            remote = state.request.remote_prefill is not None and state.transfer_done_at is None
            tokens = state.num_tokens - computed
            if not remote:
                tokens = min(tokens, budget)
            total = math.ceil((computed + tokens) / block_size)
            if self._blocks.allocation_cost(hit_keys, total) > self._blocks.num_free:
                break
            self.waiting.popleft()
            state.blocks, _ = self._blocks.allocate(hit_keys, total)
            state.computed = state.cached_tokens = computed
            state.registered = len(hit_keys)
            self.stats.prefix_cache_queries += state.num_tokens
            self.stats.prefix_cache_hits += computed
            self._membership += 1
            if remote:  # its KV comes over the wire, alongside the steps
                state.transfer_done_at = now + self.profile.kv_transfer_s(tokens)
                self.transferring.append(state)
                continue
            state.phase = Phase.RUNNING
            self.running.append(state)
            admitted.append((state, tokens))
            budget -= tokens
            if adapter is not None:
                adapters.add(adapter)
        self.waiting.extendleft(reversed(skipped))
        return admitted

    def _settle_transfers(self, now: float) -> None:
        """Held blocks read by now go; decode requests whose KV arrived by now run."""
        super()._settle_transfers(now)
        landed = [s for s in self.transferring if (s.transfer_done_at or 0.0) <= now]
        if not landed:
            return
        self.transferring = [s for s in self.transferring if s not in landed]
        for state in landed:
            self._count_transfer(len(state.request.prompt) - state.cached_tokens)
            # vLLM counts the prompt computed once its KV is in, less the last
            # token: that one is computed here to sample the first output token.
            state.computed = len(state.request.prompt) - 1
            self._cache_full_blocks(state)
            state.phase = Phase.RUNNING
            self.running.append(state)
        self._membership += 1

    def _count_transfer(self, tokens: int) -> None:
        """A finished read of ``tokens`` tokens' KV, in vLLM's NIXL histograms."""
        profile = self.profile
        size = tokens * profile.kv_bytes_per_token
        self.stats.nixl_post_time.observe(profile.kv_transfer_setup_s)
        self.stats.nixl_xfer_time.observe(size / profile.kv_transfer_bytes_per_s)
        self.stats.nixl_bytes_transferred.observe(size)

    def _preempt_v1(self, state: RequestState) -> None:
        """Recompute preemption: blocks freed (full ones stay cached), back to the queue front."""
        self._preempt(state)
        state.computed = state.registered = 0
        self.waiting.appendleft(state)

    # -- prefix caching -------------------------------------------------------------------

    def _block_keys(self, state: RequestState, blocks: int) -> tuple[int, ...]:
        """The chained cache keys of the request's first ``blocks`` full blocks."""
        if not self.profile.enable_prefix_caching:
            return ()
        keys = state.keys or ()
        if len(keys) < blocks:
            size = self.profile.block_size
            chained = list(keys)
            parent = (
                chained[-1]
                if chained
                else root_hash(state.request.adapter or self.profile.base_model)
            )
            for block in range(len(chained), blocks):
                parent = chain_hash(parent, state.token_ids(block * size, (block + 1) * size))
                chained.append(parent)
            state.keys = keys = tuple(chained)
        return keys[:blocks]

    def _cache_full_blocks(self, state: RequestState) -> None:
        """Enter the blocks the step filled into the prefix cache (one BlockStored per run)."""
        full = min(state.computed // self.profile.block_size, len(state.blocks))
        if full <= state.registered or not self.profile.enable_prefix_caching:
            return
        keys = self._block_keys(state, full)
        run: list[int] = []
        for index in range(state.registered, full):
            if self._blocks.register(state.blocks[index], keys[index]):
                run.append(index)
                continue
            self._record_stored(state, run)
            run = []
        self._record_stored(state, run)
        state.registered = full
