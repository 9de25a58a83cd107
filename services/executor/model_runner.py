"""The executor's core: holds the model, the paged KV cache and per-request state, and turns
each step's plan into one forward pass and one batched sampling call."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

import torch

from kernels import ops
from services.executor.cuda_graphs import DecodeGraphs
from services.executor.sampler import PendingSample, Sampler, SamplingRow
from services.executor.step_buffers import StepBuffers, StepView
from services.executor.weights import load_model
from shared.config import Config
from shared.model_config import ModelConfig, ModelSource
from shared.protocol import ModelRunnerOutput, NewRequestData, SamplingParams, SchedulerOutput

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_BYTES = 1 << 30
CUDA_GRAPH_RESERVE = 512 << 20  # decode graphs' activations and workspace, a loose bound


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
    def __init__(
        self, config: Config, source: ModelSource, model_config: ModelConfig, max_model_len: int
    ) -> None:
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        self.model_config = model_config
        self.max_model_len = max_model_len
        torch.manual_seed(config.seed)
        self.model = load_model(
            source,
            model_config,
            config.load_format,
            self.dtype,
            self.device,
            max_position=max_model_len,
            seed=config.seed,
        )
        max_blocks = -(-max_model_len // self.block_size)
        self.buffers = StepBuffers(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            max_blocks,
            self.block_size,
            self.device,
        )
        self.row_owner: list[RequestState | None] = [None] * config.max_num_seqs
        self.use_graphs = self.device.type == "cuda" and not config.enforce_eager
        self.num_blocks = self._num_kv_blocks(config)
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB), %.1f sequences of %d",
            self.num_blocks,
            self.block_size,
            self.num_blocks * self.block_size,
            self.num_blocks * self._bytes_per_block() / 2**30,
            self.num_blocks * self.block_size / max_model_len,
            max_model_len,
        )
        self.sampler = Sampler(
            model_config.vocab_size, model_config.eos_token_ids, self.device, config.seed
        )
        self.requests: dict[str, RequestState] = {}
        self._in_flight: deque[InFlightStep] = deque()  # oldest first, at most two
        # The last step's sampled ids, where the next step's decodes read their input token.
        self.sampled_ids = torch.zeros(config.max_num_seqs, dtype=torch.int64, device=self.device)
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = DecodeGraphs(
                self._forward, self.buffers, config.max_num_seqs, max_model_len
            )
            with torch.inference_mode():
                self.graphs.capture()

    # ------------------------------------------------------------------ memory

    def _bytes_per_block(self) -> int:
        cfg = self.model_config
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize
        return per_token * self.block_size

    def _allocate_kv_cache(self, num_blocks: int) -> list[torch.Tensor]:
        cfg = self.model_config
        shape = (2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_layers)
        ]

    def _num_kv_blocks(self, config: Config) -> int:
        if config.num_gpu_blocks_override is not None:
            return config.num_gpu_blocks_override
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            budget = self._cuda_kv_budget(config.gpu_memory_utilization)
        else:
            budget = DEFAULT_CPU_KV_BYTES
        num_blocks = budget // self._bytes_per_block()
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache; raise --gpu-memory-utilization")
        return num_blocks

    def _cuda_kv_budget(self, utilization: float) -> int:
        """What is left under `utilization` after weights and the peak of a largest step."""
        peak = self._profile_step_peak()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free  # weights, CUDA context, libraries
        reserve = CUDA_GRAPH_RESERVE if self.use_graphs else 0
        budget = int(total * utilization) - used - peak - reserve
        logger.info(
            "memory: %.1f GiB total, %.1f GiB in use, %.2f GiB peak activations, "
            "%.1f GiB left for the KV cache at --gpu-memory-utilization %.2f",
            total / 2**30,
            used / 2**30,
            peak / 2**30,
            max(budget, 0) / 2**30,
            utilization,
        )
        return budget

    @torch.inference_mode()
    def _profile_step_peak(self) -> int:
        """Bytes one step of max_num_batched_tokens prompt tokens allocates beyond the weights."""
        num_tokens = self.buffers.max_tokens
        per_request = min(num_tokens, self.max_model_len)
        counts = [per_request] * (num_tokens // per_request)
        if num_tokens % per_request:
            counts.append(num_tokens % per_request)
        counts = counts[: self.buffers.max_reqs]
        num_blocks = sum(-(-c // self.block_size) for c in counts)
        kv_caches = self._allocate_kv_cache(num_blocks)
        tables, next_block = [], 0
        for count in counts:
            size = -(-count // self.block_size)
            tables.append(list(range(next_block, next_block + size)))
            next_block += size
        vocab = self.model_config.vocab_size
        token_ids = torch.randint(0, vocab, (sum(counts),)).tolist()
        num_samples = min(self.buffers.max_reqs, len(token_ids))
        for row, block_ids in enumerate(tables):
            self.buffers.set_table_row(row, block_ids)
        self.buffers.write(token_ids, [0] * len(counts), counts, list(range(num_samples)))
        self.buffers.copy_to_device()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        view = self.buffers.view()
        hidden = self.model(view.input_ids, view.positions, kv_caches, view.meta)
        logits = self.model.compute_logits(hidden[view.sample_rows]).float()  # [S, vocab]
        logits.sort(dim=-1)  # the sampler's top-k/top-p sort is its largest temporary
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - baseline
        del kv_caches, hidden, logits
        torch.cuda.empty_cache()
        return peak

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
        sample_ids, graph_size = self._write_inputs(plan)
        view = self.buffers.view()
        if graph_size is not None and self.graphs is not None:
            hidden = self.graphs.replay(graph_size)
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

    def _write_inputs(self, plan: SchedulerOutput) -> tuple[list[str], int | None]:
        """Fill and send the step's inputs; returns who samples, and the graph size if any."""
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
        graph_size = None
        if self.graphs is not None:
            graph_size = self.graphs.padded_size(len(counts), len(token_ids))
        self.buffers.write(token_ids, starts, counts, sample_rows, graph_size, sources)
        for row in range(len(counts), graph_size or 0):
            self.row_owner[row] = None  # padding overwrote it
        self.buffers.copy_to_device()
        return sample_ids, graph_size

    def _write_table_row(self, row: int, state: RequestState) -> None:
        # Why track owners: a request usually keeps its row, so only new blocks are written.
        if self.row_owner[row] is state:
            self.buffers.set_table_row(row, state.block_ids, state.table_len)
        else:
            self.buffers.set_table_row(row, state.block_ids)
            self.row_owner[row] = state
        state.table_len = len(state.block_ids)
