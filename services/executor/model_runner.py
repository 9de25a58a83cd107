"""The executor's core: holds the model, the paged KV cache and per-request state, and turns
each step's plan into one forward pass and one batched sampling call."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels import ops
from services.executor.cuda_graphs import StepGraphs
from services.executor.kv_cache import (
    KVCacheLayout,
    log_kv_cache,
    num_kv_blocks,
    profile_step_peak,
)
from services.executor.sampler import PendingSample, Sampler, SamplingRow
from services.executor.step_buffers import PaddedShape, StepBuffers, StepView
from services.executor.warm_up import warm_up
from services.executor.weights import load_model
from shared.config import Config
from shared.model_config import (
    ModelConfig,
    ModelSource,
    derive_max_model_len,
    load_model_config,
    resolve_model_source,
)
from shared.protocol import (
    PROTOCOL_VERSION,
    ExecutorReady,
    ModelRunnerOutput,
    NewRequestData,
    SamplingParams,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


@dataclass(eq=False)
class RequestState:
    """What the executor remembers of a request between steps."""

    params: SamplingParams
    token_ids: list[int]  # prompt + output so far, without the tokens in flight
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    table_len: int = field(default=0)  # blocks already in its block-table row
    num_pending: int = field(default=0)  # tokens being sampled by steps in flight
    sample_row: int = field(default=0)  # its row in the last sampled ids, if num_pending
    # Read per step: penalties need the tokens in flight on the host (see submit).
    has_penalties: bool = field(default=False)

    @classmethod
    def from_new(cls, data: NewRequestData) -> RequestState:
        return cls(
            params=data.sampling_params,
            token_ids=data.prompt_token_ids + data.output_token_ids,
            prompt_token_ids=list(data.prompt_token_ids),
            output_token_ids=list(data.output_token_ids),
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            has_penalties=data.sampling_params.has_penalties,
        )

    @property
    def num_tokens(self) -> int:
        """Its length once every token in flight has arrived."""
        return len(self.token_ids) + self.num_pending

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.num_pending -= 1

    def sampling_row(self) -> SamplingRow:
        # Why no copies: the sampler only reads the lists, and copying a long prompt for
        # every request in every step adds up.
        return SamplingRow(
            self.params, self.prompt_token_ids, self.output_token_ids, self.num_pending
        )


@dataclass
class InFlightStep:
    """A submitted step; `finish` waits for its tokens and hands them to their requests."""

    step: int
    sample_ids: list[str]
    states: list[RequestState]
    pending: PendingSample | None
    output: ModelRunnerOutput | None = None

    def finish(self) -> ModelRunnerOutput:
        if self.output is not None:
            return self.output
        if self.pending is None:
            self.output = ModelRunnerOutput(step=self.step, sampled={})
            return self.output
        result = self.pending.result()
        for state, token_id in zip(self.states, result.token_ids, strict=True):
            state.append(token_id)
        pairs = zip(self.sample_ids, result.logprobs, strict=True)
        self.output = ModelRunnerOutput(
            step=self.step,
            sampled=dict(zip(self.sample_ids, result.token_ids, strict=True)),
            logprobs={rid: lp for rid, lp in pairs if lp is not None},
        )
        return self.output


class ModelRunner:
    """The executor's core: resolves and loads the model, sizes the KV cache, runs steps."""

    def __init__(self, config: Config) -> None:
        self.source: ModelSource = resolve_model_source(config.model)
        self.model_config: ModelConfig = load_model_config(self.source)
        self.max_model_len = derive_max_model_len(config.max_model_len, self.model_config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        torch.manual_seed(config.seed)
        self.model = load_model(
            self.source,
            self.model_config,
            config.load_format,
            self.dtype,
            self.device,
            max_position=self.max_model_len,
            seed=config.seed,
        )
        max_blocks = -(-self.max_model_len // self.block_size)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks,
            self.block_size,
            self.device,
        )
        self.row_owner: list[RequestState | None] = [None] * config.max_num_seqs
        self.kv_layout = KVCacheLayout.of(self.model_config, self.block_size, self.dtype)
        self.num_blocks = num_kv_blocks(
            config,
            self.kv_layout,
            self.device,
            lambda: profile_step_peak(self.model, self.buffers, self.kv_layout, self.max_model_len),
        )
        self.kv_caches = self.kv_layout.allocate(self.num_blocks, self.device)
        log_kv_cache(self.kv_layout, self.num_blocks, self.max_model_len)
        self.sampler = Sampler(
            self.model_config.vocab_size, self.model_config.eos_token_ids, self.device, config.seed
        )
        self.requests: dict[str, RequestState] = {}
        self._in_flight: deque[InFlightStep] = deque()  # oldest first, at most two
        # The last step's sampled ids, where the next step's decodes read their input token.
        self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.graphs: StepGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graphs = StepGraphs(
                self._forward, self.buffers, config.max_num_seqs, self.max_model_len
            )
            with torch.inference_mode():
                self.graphs.capture()
        if self.device.type == "cuda":
            warm_up(self)

    def ready_message(self, model_name: str) -> ExecutorReady:
        """What the scheduler is built from: the model's facts and this runner's limits."""
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
        )

    # ------------------------------------------------------------------ a step

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its tokens."""
        self.submit(plan)
        return self.collect()

    @torch.inference_mode()
    def submit(self, plan: SchedulerOutput) -> None:
        """Queue the step's work on the device and return without waiting for it.

        The step may run before the step in flight has been collected: a decode whose input
        is that step's token reads it on the device (`sampled_ids`), so the device goes from
        one step to the next without waiting for the host. At most two steps are in flight.
        """
        if len(self._in_flight) > 1:
            raise RuntimeError("submit() with two steps in flight: collect() one first")
        self._apply_plan(plan)
        if not plan.num_scheduled_tokens:
            self._in_flight.append(InFlightStep(plan.step, [], [], None))
            return
        if any(self.requests[rid].has_penalties for rid in plan.num_scheduled_tokens):
            self._finish_in_flight()  # penalties need the tokens in flight on the host
        sample_ids, graph_shape = self._write_inputs(plan)
        view = self.buffers.view()
        if graph_shape is not None and self.graphs is not None:
            hidden = self.graphs.replay(graph_shape)
        else:
            hidden = self._forward(view)
        logits = self.model.compute_logits(hidden[view.sample_rows])  # [S, vocab]
        states = [self.requests[rid] for rid in sample_ids]
        pending = self.sampler.sample(logits, [s.sampling_row() for s in states])
        if pending.token_ids is not None:
            self.sampled_ids[: len(states)].copy_(pending.token_ids, non_blocking=True)
        for row, state in enumerate(states):
            state.num_pending += 1
            state.sample_row = row
        self._in_flight.append(InFlightStep(plan.step, sample_ids, states, pending))

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest step in flight; its tokens join their requests."""
        if not self._in_flight:
            raise RuntimeError("collect() without a step in flight")
        return self._in_flight.popleft().finish()

    def _finish_in_flight(self) -> None:
        for step in self._in_flight:
            step.finish()

    def _forward(self, view: StepView) -> torch.Tensor:
        ops.gather_sampled_inputs(view.input_ids, view.source_rows, self.sampled_ids)
        return self.model(view.input_ids, view.positions, self.kv_caches, view.meta)

    def _apply_plan(self, plan: SchedulerOutput) -> None:
        for request_id in plan.finished_request_ids:
            self.requests.pop(request_id, None)
        for data in plan.new_requests:
            self.requests[data.request_id] = RequestState.from_new(data)
        for delta in plan.cached_requests:
            state = self.requests[delta.request_id]
            state.block_ids.extend(delta.new_block_ids)
            state.num_computed_tokens = delta.num_computed_tokens

    def _write_inputs(self, plan: SchedulerOutput) -> tuple[list[str], PaddedShape | None]:
        """Fill and send the step's inputs; returns who samples, and the graph shape if any."""
        token_ids: list[int] = []
        starts, counts = [], []
        sample_ids: list[str] = []
        sample_rows: list[int] = []
        sources: list[tuple[int, int]] = []  # (token index, row of sampled_ids)
        self.buffers.wait_for_copy()  # the table rows below go into the copy's source
        for row, (request_id, num_new) in enumerate(plan.num_scheduled_tokens.items()):
            state = self.requests[request_id]
            start = state.num_computed_tokens
            end = start + num_new
            first = len(token_ids)
            token_ids.extend(state.token_ids[start:end])
            if len(token_ids) < first + num_new:
                # NOTE: only a request's last token can be in flight (the scheduler readmits
                # a preempted request once its tokens are in), so one is missing at most.
                if end != state.num_tokens or state.num_pending != 1:
                    raise RuntimeError(f"request_id={request_id}: inputs {start}:{end} unknown")
                sources.append((len(token_ids), state.sample_row))
                token_ids.append(0)  # a placeholder the device overwrites
            starts.append(start)
            counts.append(num_new)
            self._write_table_row(row, state)
            state.num_computed_tokens = end
            if end == state.num_tokens:  # reached the end: sample the next
                sample_ids.append(request_id)
                sample_rows.append(len(token_ids) - 1)
        shape = None
        if self.graphs is not None:
            shape = self.graphs.shape_for(len(counts), len(token_ids))
        self.buffers.write(token_ids, starts, counts, sample_rows, shape, sources)
        if shape is not None and shape.decode:
            for row in range(len(counts), shape.num_reqs):
                self.row_owner[row] = None  # decode padding overwrote it
        self.buffers.copy_to_device()
        return sample_ids, shape

    def _write_table_row(self, row: int, state: RequestState) -> None:
        # Why track owners: a request usually keeps its row, so only new blocks are written.
        if self.row_owner[row] is state:
            self.buffers.set_table_row(row, state.block_ids, state.table_len)
        else:
            self.buffers.set_table_row(row, state.block_ids)
            self.row_owner[row] = state
        state.table_len = len(state.block_ids)
