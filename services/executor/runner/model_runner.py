"""The executor's core: holds the model, the paged KV cache and per-request state, and turns
each step's plan into one forward pass and one batched sampling call."""

from __future__ import annotations

import dataclasses
import logging
from collections import deque
from collections.abc import Sequence

import torch

from kernels import ops
from kernels.pdl import set_pdl
from services.executor.loading.loader import load_model
from services.executor.lora.manager import LoraManager
from services.executor.parallel.symmetric_memory import with_peer_buffers
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from services.executor.runner import proposers
from services.executor.runner.cuda_graphs import StepGraphs
from services.executor.runner.devices import resolve_device, resolve_dtype, start_up_compiles
from services.executor.runner.drafting import choose_drafts, propose_after
from services.executor.runner.grammar import GrammarMatchers
from services.executor.runner.host_kv import HostKVPool, tier_facts
from services.executor.runner.invariance import apply_batch_invariant
from services.executor.runner.kv_cache import (
    KVCacheLayout,
    kv_groups_for,
    log_kv_cache,
    log_kv_scales,
    num_kv_blocks,
    profile_step_peak,
    set_kv_groups,
)
from services.executor.runner.kv_exports import device_buffer_bytes
from services.executor.runner.kv_handover import Handover, move_kv, report_kv, reset_kv
from services.executor.runner.plan_check import PlanError, PlanLimits, check_plan
from services.executor.runner.plan_relay import PlanRelay
from services.executor.runner.pooling import pool_chunk
from services.executor.runner.prompt_logprobs import prompt_logprobs
from services.executor.runner.replica_rounds import (
    before_capture,
    launch_round,
    refuse_drafts_across_replicas,
)
from services.executor.runner.sampler import Sampler, TokenBitmask, step_seed
from services.executor.runner.step_buffers import StepBuffers, StepView
from services.executor.runner.step_state import (
    DeviceSpan,
    InFlightStep,
    PreparedStep,
    RequestState,
    needs_collected_tokens,
    recorded_event,
)
from services.executor.runner.warm_up import warm_up
from shared.config import Config
from shared.hf_tokenizer import load_tokenizer
from shared.lora_modules import parse_lora_modules
from shared.model_config import (
    ModelConfig,
    ModelSource,
    derive_max_model_len,
    load_model_config,
    resolve_model_source,
)
from shared.pooling import load_pooling_config, resolve_task
from shared.protocol import (
    PROTOCOL_VERSION,
    AddLoraAdapter,
    ExecutorReady,
    ModelRunnerOutput,
    ResetRanks,
    SchedulerOutput,
)
from shared.speculative import parse_speculative_config, speculates

logger = logging.getLogger(__name__)


class ModelRunner:
    """The executor's core: resolves and loads the model, sizes the KV cache, runs steps."""

    def __init__(
        self, config: Config, tp: TensorParallel = ONE_RANK, relay: PlanRelay | None = None
    ) -> None:
        """`tp`: this process's place in a tensor-parallel group, whose ranks all run the same
        steps (services/executor/parallel/tensor_parallel.py); `relay`: on rank 0, where the
        plans go on to the other ranks (services/executor/rank_group.py)."""
        self.relay: PlanRelay | None = None  # set last: the warm-up steps run on each rank alone
        self.device = resolve_device(config.device, tp.rank)
        # Triton's compiles until the warm-up ends are meant; any later one is logged.
        with start_up_compiles(self.device):
            self._start(config, tp)
        self.relay = relay

    def _start(self, config: Config, tp: TensorParallel) -> None:
        """Loads the model, sizes and allocates the KV cache, captures graphs, warms up."""
        set_pdl(not config.disable_pdl)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self._load_model(config, tp)
        self.speculative = parse_speculative_config(config.speculative_config)
        self.proposer = proposers.proposer_for(self.speculative, config, self)
        self.num_drafts = self.speculative.num_speculative_tokens if self.speculative else 0
        self.kv_groups = kv_groups_for(config, self.model_config, self.speculative)
        set_kv_groups(self.model, self.kv_groups)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens, config.max_num_seqs,
            -(-self.max_model_len // self.block_size),  # table columns: the longest request
            self.block_size, self.device,
            max_samples=config.max_num_seqs * (1 + self.num_drafts),  # a row samples after each
            decode_queries=1 + self.num_drafts, long_rope=self.model.long_rope,
            num_groups=self.kv_groups.num_groups,
        )  # fmt: skip
        self.row_owner: list[RequestState | None] = [None] * config.max_num_seqs
        self._allocate_kv_cache(config)
        self._plan_limits = PlanLimits(
            self.model_config.vocab_size, self.num_blocks, self.block_size, self.max_model_len,
            self.buffers.max_reqs, self.max_num_batched_tokens,
            self.lora.registered if self.lora is not None else (),  # live: adapters come, go
            self.num_drafts, self.host_kv.num_slots if self.host_kv is not None else 0,
            self.kv_groups.num_groups,
        )  # fmt: skip
        self._make_samplers(config)
        self.requests: dict[str, RequestState] = {}
        proposers.allocate_kv_cache(self.proposer, self.num_blocks)
        self._in_flight: deque[InFlightStep] = deque()  # oldest first, at most two
        self._prepared: PreparedStep | None = None
        # The last step's sampled ids, where the next step's decodes read their input token.
        self.sampled_ids = torch.zeros(self.buffers.max_samples, dtype=torch.int64).to(self.device)
        refuse_drafts_across_replicas(self.tp, self.proposer is not None)
        self.graphs: StepGraphs | None = None
        if StepGraphs.supports(self.device) and not config.enforce_eager:
            self.graphs = StepGraphs(
                self.forward, self.buffers, config.max_num_seqs, self.max_model_len,
                before_capture=before_capture(self.tp, self.device),
            )  # fmt: skip
            with torch.inference_mode():
                self.graphs.capture()
        if self.device.type == "cuda":
            warm_up(self)

    def _load_model(self, config: Config, tp: TensorParallel) -> None:
        """The model's config and weights (this rank's part), and the LoRA slots."""
        self.source: ModelSource = resolve_model_source(config.model)
        self.model_config: ModelConfig = load_model_config(self.source)
        self.max_model_len = derive_max_model_len(config.max_model_len, self.model_config)
        self.task = resolve_task(config.task, self.source)
        self.pooling = load_pooling_config(self.source)  # for embed requests
        if self.task == "embed":
            # Its sampled token is dropped, so the lm_head is never read: tied to the embedding,
            # it needs no weights (embedding checkpoints, as AutoModel saves them, have none).
            self.model_config = dataclasses.replace(self.model_config, tie_word_embeddings=True)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if not config.disable_custom_all_reduce:
            hidden, vocab = self.model_config.hidden_size, self.model_config.vocab_size
            tp = with_peer_buffers(tp, hidden, vocab // tp.size, self.dtype, self.device)
        self.tp = tp
        torch.manual_seed(config.seed)
        self.model = load_model(
            self.source, self.model_config, config.load_format, self.dtype, self.device,
            max_position=self.max_model_len, seed=config.seed, quantization=config.quantization,
            tp=tp,
        )  # fmt: skip
        apply_batch_invariant(config, self.model, self.model_config, self.dtype, tp.size)
        # Before the KV cache is sized: the slots take device memory for good.
        self.lora: LoraManager | None = None
        if config.enable_lora:
            self.lora = LoraManager(
                self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                self.dtype, self.device, parse_lora_modules(config.lora_modules),
            )  # fmt: skip

    def _allocate_kv_cache(self, config: Config) -> None:
        """As many KV blocks as the memory left holds, on every rank alike."""
        kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        local_config = self.model.layout.local_config  # a rank's cache: its own KV heads
        self.kv_layout = KVCacheLayout.of(local_config, self.block_size, kv_dtype, self.kv_groups)
        self.num_blocks = num_kv_blocks(
            config, self.kv_layout, self.device,
            lambda: profile_step_peak(self.model, self.buffers, self.kv_layout, self.max_model_len),
            proposers.bytes_per_block(self.proposer),
            device_buffer_bytes(config, self.kv_layout, self.device),
        )  # fmt: skip
        # Every rank must hold the blocks any plan names.
        self.num_blocks = self.tp.smallest(self.num_blocks, self.device)
        self.kv_caches = self.kv_layout.allocate(self.num_blocks, self.device)
        self.host_kv = HostKVPool.sized(config, self.kv_layout, self.kv_caches, self.tp)
        self.handover = Handover.start(config, self.kv_caches, self.tp)
        log_kv_cache(self.kv_layout, self.num_blocks, self.max_model_len, self.kv_groups)
        log_kv_scales(self.model, kv_dtype)

    def _make_samplers(self, config: Config) -> None:
        """The token sampler and the grammar matchers of structured output."""
        # Each replica samples with its own seed (the weights' is shared: dummy weights alike)
        seed = config.seed if config.replica == 0 else step_seed(config.seed, config.replica)
        self.sampler = Sampler(
            self.model_config.vocab_size, self.model_config.eos_token_ids, self.device, seed
        )
        # Why locals: a lambda over self would make a cycle, and a deleted engine would hold
        # its GPU memory until the garbage collector ran.
        source, tokenizer_path, cache_dir = self.source, config.tokenizer, config.cache_dir
        self.grammars = GrammarMatchers(
            lambda: load_tokenizer(source, tokenizer_path, cache_dir),
            self.model_config.vocab_size,
            list(self.model_config.eos_token_ids),
        )

    def ready_message(self, model_name: str, session: int | None = None) -> ExecutorReady:
        """What the scheduler is built from: the model's facts and this runner's limits;
        `session`: the SchedulerHello this answers (None: unasked, at start)."""
        return ExecutorReady(
            protocol_version=PROTOCOL_VERSION,
            model_name=model_name,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
            max_num_seqs=self.buffers.max_reqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            session=session,
            max_loras=self.lora.max_loras if self.lora is not None else 0,
            lora_modules=self.lora.modules if self.lora is not None else [],
            num_speculative_tokens=self.num_drafts,
            **tier_facts(self.host_kv, self.kv_layout.bytes_per_block * self.tp.size),
            long_rope_after=self.model_config.long_rope_after,
            kv_windows=list(self.kv_groups.windows),
        )

    def reset(self) -> None:
        """Forget every request and step, for a new scheduler that starts from nothing. Steps
        still on the device finish first (their tokens are dropped): the pinned buffers their
        results go to must not be reused while copies into them are queued."""
        if self.relay is not None:
            self.relay.send(ResetRanks())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.requests.clear()
        if self.proposer is not None:
            self.proposer.reset()
        self._in_flight.clear()
        self._prepared = None
        if self.lora is not None:
            self.lora.reset()
        reset_kv(self.host_kv, self.handover)
        self.row_owner = [None] * len(self.row_owner)

    # ------------------------------------------------------------------ a step

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        self.submit(plan)
        return self.collect()

    def submit(self, plan: SchedulerOutput) -> None:
        """Queue the step's work on the device and return without waiting for it.

        The step may run before the step in flight has been collected: a decode whose input
        is that step's token reads it on the device (`sampled_ids`), so the device goes from
        one step to the next without waiting for the host. At most two steps are in flight.
        """
        self.prepare(plan)
        self.launch(plan.step)

    def _check(self, plan: SchedulerOutput, prepared: PreparedStep | None = None) -> None:
        def held(request_id: str) -> tuple[int, int] | None:
            state = self.requests.get(request_id)
            return None if state is None else state.held(self.num_drafts)

        rows_and_tokens = (len(prepared.counts), len(prepared.token_ids)) if prepared else (0, 0)
        check_plan(plan, self._plan_limits, held, *rows_and_tokens)

    @torch.inference_mode()
    def prepare(self, plan: SchedulerOutput) -> None:
        """Take the plan and fill its inputs on the host; `launch` sends them to the device.
        Raises PlanError for a plan it cannot run: before touching anything, but for LoRA
        adapters that cannot be put in slots (too many, files gone), found as rows are added;
        the caller then resets."""
        if self._prepared is not None:
            raise PlanError(f"plan {plan.step} before plan {self._prepared.step} launched")
        if needs_collected_tokens(plan, self.requests, self._in_flight):  # a rank behind
            self._finish_in_flight()
        self._check(plan)
        self._apply_plan(plan)
        if self.tp.rank == 0:  # the others read rank 0's drafts in the plan it relays
            choose_drafts(plan, self.requests, self._in_flight, self.proposer)
        if self.relay is not None:
            self.relay.send(plan)
        self._prepared = PreparedStep(plan.step, self.block_size, self.kv_groups.num_groups)
        move_kv(self.host_kv, self.handover, plan)  # queued now: after the last step, before this
        self._add_rows(plan)

    @torch.inference_mode()
    def amend(self, addendum: SchedulerOutput) -> None:
        """Append an addendum's requests to the prepared plan of the same step."""
        if self.relay is not None:
            self.relay.send(addendum)
        if self._prepared is None or self._prepared.step != addendum.step:
            raise PlanError(f"an addendum to plan {addendum.step}, which is not held")
        self._check(addendum, self._prepared)
        move_kv(self.host_kv, self.handover, addendum)
        self._apply_plan(addendum)
        self._add_rows(addendum)

    def accepts_addendum(self, step: int) -> bool:
        return self._prepared is not None and self._prepared.step == step

    def holds_plan(self) -> bool:
        return self._prepared is not None

    @torch.inference_mode()
    def launch(self, step: int, replica_rows: Sequence[int] = (), mixed: bool = False) -> None:
        """Send the prepared plan's inputs and queue its forward pass and sampling."""
        prepared = self._prepared
        if prepared is None or prepared.step != step:
            raise PlanError(f"launch of plan {step}, which is not prepared")
        if len(self._in_flight) > 1:
            raise RuntimeError("launch() with two steps in flight: collect() one first")
        launch_round(self, prepared, replica_rows, mixed)  # relays the launch
        self._prepared = None
        if not prepared.counts:
            self._in_flight.append(InFlightStep(step, [], [], None))
            return
        started = DeviceSpan.mark(self.device)
        self.buffers.copy_to_device()
        if prepared.shape is None or self.graphs is None:
            hidden = self.forward(view := self.buffers.view())
        else:
            hidden = self.graphs.replay(prepared.shape)
            view = self.buffers.view()  # after: the device computes while the host makes it
        forward_done = recorded_event(self.device)
        self.handover.after_forward(step)  # the prompts this step completes go out now
        logits = self.model.compute_logits(hidden[view.sample_rows])  # [S, vocab]
        states = [self.requests[rid] for rid in prepared.sample_ids]
        token_bitmask = self._token_bitmask(states, prepared)
        pending = self.sampler.sample(logits, prepared.sampling_rows(states), token_bitmask)
        if pending.token_ids is not None:
            self.sampled_ids[: len(states)].copy_(pending.token_ids, non_blocking=True)
        for row, (state, ahead) in enumerate(zip(states, prepared.sample_ahead, strict=True)):
            state.num_pending += ahead == 0  # one step's tokens arrive together
            state.sample_row, state.sample_step = row, step
        prompt_parts = [
            prompt_logprobs(self.model, hidden, self.requests[rows[0]], *rows)
            for rows in prepared.prompt_rows
        ]
        pooled = [
            (rows[0], vector)
            for rows in prepared.pool_rows
            if (vector := pool_chunk(self.pooling, hidden, self.requests[rows[0]], *rows[1:]))
            is not None
        ]
        span = DeviceSpan(started, DeviceSpan.mark(self.device))
        proposal = proposers.after_step(
            self.proposer, prepared, view, pending.token_ids, self.requests
        )
        self._in_flight.append(
            InFlightStep(
                step, prepared.sample_ids, states, pending, forward_done, span,
                prompt_parts=prompt_parts, pooled=pooled, drafts=prepared.drafts, proposal=proposal,
            )
        )  # fmt: skip

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest step in flight; its tokens join their requests."""
        if not self._in_flight:
            raise RuntimeError("collect() without a step in flight")
        step = self._in_flight.popleft()
        output = step.finish()
        report_kv(self.host_kv, self.handover, output, idle=step.pending is None)
        if self.tp.rank == 0:  # the other ranks read rank 0's drafts in the plans it relays
            propose_after(self.proposer, step, self.requests)
        return output

    @property
    def num_in_flight(self) -> int:
        return len(self._in_flight)

    def oldest_finished(self) -> bool:
        """Whether `collect` would return without waiting."""
        return bool(self._in_flight) and self._in_flight[0].finished

    def launch_point_passed(self) -> bool:
        """Whether the last step launched has finished its forward pass (or none is in
        flight): launched now, the next step keeps the device busy without waiting long."""
        if not self._in_flight:
            return True
        event = self._in_flight[-1].forward_done
        return event is None or event.query()

    def _token_bitmask(
        self, states: list[RequestState], prepared: PreparedStep
    ) -> TokenBitmask | None:
        """The allowed next tokens of the positions under a grammar, computed on the host
        while the step's forward pass runs on the device.

        NOTE: a grammar's next mask depends on its last token, which the step in flight may
        still be sampling (a row in its reasoning, the reasoning's end): it is waited for
        here, after this step's forward pass has been queued behind it, so the wait costs the
        device nothing.
        """
        if any(state.matcher is not None and state.num_pending for state in states):
            self._finish_in_flight()
        return self.grammars.step_bitmask(prepared.grammar_rows(states), self.device)

    def _finish_in_flight(self) -> None:
        for step in self._in_flight:
            step.finish()

    def forward(self, view: StepView) -> torch.Tensor:
        """The model over the step in the buffers (`view`): its hidden states."""
        ops.gather_sampled_inputs(view.input_ids, view.source_rows, self.sampled_ids)
        lora = view.lora if self.lora is not None else None
        return self.model(view.input_ids, view.positions, self.kv_caches, view.meta, lora)

    def add_lora(self, lora_id: int, name: str, path: str) -> str | None:
        """Take a LoRA adapter under `lora_id` (read and checked now); None, or why not. Rank
        0 relays one it took to the other ranks, ahead of any plan that runs it."""
        if self.lora is None:
            return "LoRA is not enabled (--enable-lora)"
        if (refusal := self.lora.try_add(lora_id, name, path)) is not None:
            return refusal
        if self.relay is not None:
            self.relay.send(AddLoraAdapter(lora_id=lora_id, name=name, path=path))
        return None

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None and self.proposer is not None:
                self.proposer.finished(request_id, state.output_token_ids)
        for data in plan.new_requests:
            spec = data.sampling_params.structured_output
            matcher = None
            if spec is not None:
                matcher = self.grammars.matcher(spec, data.output_token_ids)
            speculating = self.speculative is not None and speculates(data.sampling_params)
            self.requests[data.request_id] = RequestState.from_new(data, matcher, speculating)
        for delta in plan.cached_requests:
            state = self.requests[delta.request_id]
            state.block_ids.extend(delta.new_block_ids)
            if not state.speculates:  # else the plan's count may include drafts in flight
                state.num_computed_tokens = delta.num_computed_tokens

    def _add_rows(self, plan: SchedulerOutput) -> None:
        """Append the plan's requests to the prepared step and rewrite the host mirror (across
        replicas at launch: services/executor/runner/replica_rounds.py)."""
        prepared = self._prepared
        assert prepared is not None
        if not plan.num_scheduled_tokens:
            return
        # Penalties need the tokens in flight on the host (a new request has none).
        states = [self.requests[rid] for rid in plan.num_scheduled_tokens]
        if any(state.has_penalties and state.num_pending for state in states):
            self._finish_in_flight()
        self.buffers.wait_for_copy()  # the table rows below go into the copy's source
        for state, (request_id, num_new) in zip(
            states, plan.num_scheduled_tokens.items(), strict=True
        ):
            drafts = plan.spec_token_ids.get(request_id, [])
            num_new += len(drafts) - plan.draft_slots.get(request_id, 0)  # the slots unused
            prepared.add_row(request_id, state, num_new, drafts)
            self._write_table_row(len(prepared.counts) - 1, state)
        if self.lora is not None:  # a step's adapters in slots before its inputs name them
            try:
                prepared.row_slots = self.lora.row_slots(prepared.lora_ids)
            except (ValueError, OSError) as exc:  # more adapters than slots; files gone
                raise PlanError(f"plan {prepared.step}: its LoRA adapters: {exc}") from exc
        if self.tp.replicas is not None:  # written at launch, padded to the round's rows
            return
        if self.graphs is not None:
            prepared.shape = self.graphs.shape_for(
                len(prepared.counts), len(prepared.token_ids), max(prepared.counts, default=0)
            )
        self.write_inputs(prepared)

    def write_inputs(self, prepared: PreparedStep) -> None:
        """The prepared step's inputs into the host mirror, padded to its graph's shape."""
        self.buffers.write(
            prepared.token_ids, prepared.starts, prepared.counts, prepared.sample_rows,
            prepared.shape, prepared.sources, prepared.row_slots, prepared.long_rows,
        )  # fmt: skip
        if prepared.shape is not None and prepared.shape.decode:
            for row in range(len(prepared.counts), prepared.shape.num_reqs):
                self.row_owner[row] = None  # decode padding overwrote it

    def _write_table_row(self, row: int, state: RequestState) -> None:
        # Why track owners: a request usually keeps its row, so only new blocks are written;
        # both ways, as a request that skipped a step (waiting for tokens that may end it) may
        # come back to a row it left, which lacks the blocks added meanwhile.
        if self.row_owner[row] is state and state.table_row == row:
            self.buffers.set_table_row(row, state.block_ids, state.table_len)
        else:
            self.buffers.set_table_row(row, state.block_ids)
            self.row_owner[row] = state
            state.table_row = row
        state.table_len = len(state.block_ids)
