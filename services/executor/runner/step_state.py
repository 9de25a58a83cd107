"""What the executor keeps between steps: each request's state, the plan it is preparing (which
addenda may still join), and the steps launched whose tokens have not been collected."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from llguidance import LLMatcher

from services.executor.runner.grammar import grammar_input
from services.executor.runner.plan_check import PlanError
from services.executor.runner.sampler import PendingSample, SamplingRow
from services.executor.runner.step_buffers import PaddedShape
from services.executor.speculative import PendingDrafts, RowSpan
from shared.protocol import (
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SamplingParams,
    SchedulerOutput,
    TokenLogprobs,
)


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
    table_row: int = field(default=-1)  # that row
    num_pending: int = field(default=0)  # tokens being sampled by steps in flight
    sample_row: int = field(default=0)  # its row in the sampled ids of step sample_step
    sample_step: int = field(default=-1)
    # Whether its last row verified drafts: its token in flight is then at any of the row's
    # positions, and no placeholder can read it.
    verifying: bool = field(default=False)
    # Read per step: penalties need the tokens in flight on the host (see submit).
    has_penalties: bool = field(default=False)
    # Structured output: the grammar's state after the tokens above. NOTE: like penalties, its
    # next mask needs every token in flight on the host (see ModelRunner._token_bitmask).
    matcher: LLMatcher | None = field(default=None)
    # With a reasoning parser, the grammar waits for the reasoning's end token: until then the
    # row is free (and its matcher reads nothing).
    grammar_waits: bool = field(default=False)
    # Prompt logprobs still to compute: not for a request resumed after its prompt was done.
    wants_prompt_logprobs: bool = field(default=False)
    lora_id: int = field(default=0)  # its LoRA adapter (0: the base model)
    long_rope: bool = field(default=False)  # LongRoPE's long set for all its tokens
    # An embed request's pooled hidden states of the prompt chunks so far (runner/pooling.py).
    pooled: torch.Tensor | None = field(default=None)
    speculates: bool = field(default=False)  # its steps verify drafts (shared/speculative.py)
    # The drafts proposed after its last token, for its next row (runner/drafting.py).
    next_drafts: list[int] = field(default_factory=list)

    @classmethod
    def from_new(
        cls, data: NewRequestData, matcher: LLMatcher | None = None, speculates: bool = False
    ) -> RequestState:
        return cls(
            params=data.sampling_params,
            token_ids=data.prompt_token_ids + data.output_token_ids,
            prompt_token_ids=list(data.prompt_token_ids),
            output_token_ids=list(data.output_token_ids),
            block_ids=list(data.block_ids),
            num_computed_tokens=data.num_computed_tokens,
            has_penalties=data.sampling_params.has_penalties,
            matcher=matcher,
            grammar_waits=matcher is not None
            and data.sampling_params.structured_output is not None
            and grammar_input(data.sampling_params.structured_output, data.output_token_ids)
            is None,
            wants_prompt_logprobs=data.sampling_params.prompt_logprobs is not None
            and not data.output_token_ids,
            lora_id=data.lora_id,
            long_rope=data.long_rope,
            speculates=speculates,
        )

    @property
    def num_tokens(self) -> int:
        """Its length once every token in flight has arrived."""
        return len(self.token_ids) + self.num_pending

    def held(self, num_drafts: int) -> tuple[int, int]:
        """Its tokens known or in flight, at most, and its blocks: what a plan's rows for it are
        checked against (plan_check.Held). Speculating (`num_drafts` a row), the scheduler
        counts a step as bringing all its row has room for until it is reported: up to two
        steps in flight there, done here or not."""
        if not self.speculates:
            return self.num_tokens, len(self.block_ids)
        bound = len(self.token_ids) + (self.num_pending + 2) * (1 + num_drafts)
        return bound, len(self.block_ids)

    def take(self, token_ids: list[int], num_drafts: int = 0) -> None:
        """The tokens one step sampled for it: one, or accepted drafts and the one after (of
        `num_drafts` its row verified, whose KV past those accepted is not its own)."""
        self.num_pending -= 1
        self.num_computed_tokens -= num_drafts - (len(token_ids) - 1)
        for token_id in token_ids:
            self._append(token_id)

    def _append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.matcher is not None:
            if self.grammar_waits:
                spec = self.params.structured_output
                self.grammar_waits = spec is None or token_id not in spec.reasoning_end_token_ids
                return
            # A refused token (past the grammar's end, under ignore_eos) leaves the matcher in
            # its error state, whose mask allows EOS alone.
            self.matcher.consume_token(token_id)

    def allowed_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first its grammar refuses (none while the grammar waits for
        the reasoning's end: the grammar's start would fall inside the row)."""
        if self.matcher is None:
            return drafts
        if self.grammar_waits:
            return []
        return drafts[: self.matcher.validate_tokens(drafts)]

    def sampling_row(self, drafts: list[int]) -> SamplingRow:
        """Its row of the sampler, for the position after `drafts` (those of its drafts before
        it), which count as output: for min_tokens and a seeded draw, and for penalties."""
        if drafts and self.has_penalties:  # penalties read the tokens themselves
            outputs = self.output_token_ids + drafts
            return SamplingRow(self.params, self.prompt_token_ids, outputs, self.num_pending)
        # Why no copies: the sampler only reads the lists, and copying a long prompt for
        # every request in every step adds up.
        return SamplingRow(
            self.params,
            self.prompt_token_ids,
            self.output_token_ids,
            self.num_pending + len(drafts),
        )


@dataclass
class DeviceSpan:
    """A step's time on the device: CUDA timing events around its work on the stream, or on
    CPU, where a step runs synchronously, the wall clock around it (perf_counter seconds)."""

    start: torch.cuda.Event | float
    end: torch.cuda.Event | float

    @classmethod
    def mark(cls, device: torch.device) -> torch.cuda.Event | float:
        """A point in time on `device`'s stream: a recorded timing event, or the clock."""
        if device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def milliseconds(self) -> float:
        if isinstance(self.start, float) and isinstance(self.end, float):
            return (self.end - self.start) * 1000
        assert isinstance(self.start, torch.cuda.Event) and isinstance(self.end, torch.cuda.Event)
        self.end.synchronize()  # recorded right after the sampled ids' copy: microseconds
        return self.start.elapsed_time(self.end)


def recorded_event(device: torch.device) -> torch.cuda.Event | None:
    """An event recorded on the current stream now (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


@dataclass
class InFlightStep:
    """A launched step; `finish` waits for its tokens and hands them to their requests."""

    step: int
    sample_ids: list[str]
    states: list[RequestState]
    pending: PendingSample | None  # None: the step computed no rows (its plan had none)
    # Recorded after the forward pass: what is left of the step (lm_head, sampling) covers
    # the launch of the next one, which waits for this (see ModelRunner.launch_point_passed).
    forward_done: torch.cuda.Event | None = None
    span: DeviceSpan | None = None  # how long the step kept the device busy
    output: ModelRunnerOutput | None = None
    # Prompt logprobs on their way to the host: (request id, first position, their copies).
    prompt_parts: list[tuple[str, int, PendingSample]] = field(default_factory=list)
    # Embeddings made by this step: (request id, its vector [hidden]).
    pooled: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    # Speculative decoding: a row's drafts, by the index of its first sampled position;
    # with EAGLE-3, the drafts proposed on the device after the step.
    drafts: dict[int, list[int]] = field(default_factory=dict)
    proposal: PendingDrafts | None = None
    proposed: bool = False  # its drafts proposed (drafting.propose_after)

    def finish(self) -> ModelRunnerOutput:
        if self.output is not None:
            return self.output
        prompt_logprobs = {
            request_id: PromptLogprobs(start, [lp for lp in part.result().logprobs if lp])
            for request_id, start, part in self.prompt_parts
        }
        embeddings = {request_id: vector.tolist() for request_id, vector in self.pooled}
        if self.pending is None:
            self.output = ModelRunnerOutput(
                step=self.step,
                sampled={},
                device_ms=self.device_ms,
                prompt_logprobs=prompt_logprobs,
                embeddings=embeddings,
            )
            return self.output
        result = self.pending.result()
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        num_drafts: dict[str, int] = {}
        row = 0
        while row < len(self.states):
            drafts = self.drafts.get(row, [])
            tokens = accepted(result.token_ids[row : row + len(drafts) + 1], drafts)
            self.states[row].take(tokens, len(drafts))
            sampled[self.sample_ids[row]] = tokens
            if drafts:
                num_drafts[self.sample_ids[row]] = len(drafts)
            row_logprobs = [lp for lp in result.logprobs[row : row + len(tokens)] if lp]
            if row_logprobs:
                logprobs[self.sample_ids[row]] = row_logprobs
            row += len(drafts) + 1
        self.output = ModelRunnerOutput(
            step=self.step,
            sampled=sampled,
            logprobs=logprobs,
            device_ms=self.device_ms,
            num_drafts=num_drafts,
            prompt_logprobs=prompt_logprobs,
            embeddings=embeddings,
        )
        return self.output

    @property
    def device_ms(self) -> float:
        return 0.0 if self.span is None else self.span.milliseconds()

    @property
    def finished(self) -> bool:
        """Whether `finish` would not wait. NOTE: a step of prompt chunks samples nothing, so
        only its forward pass says when it ends; answered earlier, its answer could overtake
        the DeviceReady of the step after it (see services/executor/process.py)."""
        if self.output is not None:
            return True
        forward_ended = self.forward_done is None or self.forward_done.query()
        prompt_ready = all(part.ready for _, _, part in self.prompt_parts)
        return forward_ended and prompt_ready and (self.pending is None or self.pending.ready)


def accepted(targets: list[int], drafts: list[int]) -> list[int]:
    """A verified row's tokens: the target's choice at each position, up to the first that
    differs from the draft there (the target's own token then), or past the last draft.

    Exact for drafts that are single guesses (n-gram): the target's sample at a position is
    the draft with the target's probability of it, else the target's choice among the rest,
    which is what rejection sampling against a point-mass draft does.
    """
    for position, (target, draft) in enumerate(zip(targets, drafts, strict=False)):
        if target != draft:
            return targets[: position + 1]
    return targets[: len(drafts) + 1]


@dataclass
class PreparedStep:
    """A plan whose inputs are in the host mirror, not launched: addenda can still join it."""

    step: int
    block_size: int
    num_groups: int = 1  # layer groups: a request's blocks are one of each group's in turn
    token_ids: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    sample_ids: list[str] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sources: list[tuple[int, int]] = field(default_factory=list)  # (token index, sampled row)
    lora_ids: list[int] = field(default_factory=list)  # each row's LoRA adapter (0: none)
    long_rows: list[bool] = field(default_factory=list)  # each row's request's (LongRoPE)
    shape: PaddedShape | None = None
    row_slots: list[int] | None = None  # each row's LoRA slot, with LoRA
    # Requests whose prompt logprobs this step computes: (request id, token index of the first
    # position, that position, number of positions).
    prompt_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Embed requests' prompt chunks this step pools, in the same form.
    pool_rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    # Speculative decoding: each sampled position's count of drafts before it in its row,
    # and each verifying row's drafts by its first sampled position.
    sample_ahead: list[int] = field(default_factory=list)
    drafts: dict[int, list[int]] = field(default_factory=dict)
    spans: list[RowSpan] = field(default_factory=list)  # each row's

    def sampling_rows(self, states: list[RequestState]) -> list[SamplingRow]:
        """The sampler's rows, one per sampled position (`states`: per position)."""
        return [
            state.sampling_row(self.drafts[row - ahead][:ahead] if ahead else [])
            for row, (state, ahead) in enumerate(zip(states, self.sample_ahead, strict=True))
        ]

    def grammar_rows(self, states: list[RequestState]) -> list[tuple[int, LLMatcher]]:
        """Each sampled position under a grammar (`states`: per position) and the grammar's
        state it samples from: its row's matcher, or past drafts a copy that read them."""
        rows: list[tuple[int, LLMatcher]] = []
        for row, (state, ahead) in enumerate(zip(states, self.sample_ahead, strict=True)):
            if state.matcher is None or state.grammar_waits:
                continue
            matcher = state.matcher
            if ahead:
                matcher = rows[-1][1].deep_copy()  # the position before, one draft short
                matcher.consume_token(self.drafts[row - ahead][ahead - 1])
            rows.append((row, matcher))
        return rows

    def add_row(
        self, request_id: str, state: RequestState, num_new: int, drafts: list[int]
    ) -> None:
        """Append a request's next `num_new` tokens as a row of this step (its block table
        row is the runner's to write): its own, then the drafts it verifies, if any."""
        start = state.num_computed_tokens
        end = start + num_new - len(drafts)  # past its own tokens
        if start + num_new > len(state.block_ids) // self.num_groups * self.block_size:
            # The plan's checks read its counts, which are bounds for a speculating request.
            raise PlanError(f"request_id={request_id}: {start + num_new} tokens in its blocks")
        first = len(self.token_ids)
        self.token_ids.extend(state.token_ids[start:end])
        if drafts and (end != len(state.token_ids) or state.num_pending):
            raise PlanError(f"request_id={request_id}: drafts after tokens not yet known")
        if len(self.token_ids) < first + end - start:
            # NOTE: only a request's last token can be in flight (the scheduler readmits
            # a preempted request once its tokens are in), so one is missing at most.
            if end != state.num_tokens or state.num_pending != 1 or state.verifying:
                raise PlanError(f"request_id={request_id}: inputs {start}:{end} unknown")
            self.sources.append((len(self.token_ids), state.sample_row))
            self.token_ids.append(0)  # a placeholder the device overwrites
        if state.wants_prompt_logprobs and start < len(state.prompt_token_ids) - 1:
            # Position i's logits give token i + 1's logprob: the chunk's positions up to the
            # prompt's second-to-last token (the last one's logits sample the first output).
            count = min(end, len(state.prompt_token_ids) - 1) - start
            self.prompt_rows.append((request_id, first, start, count))
        if state.params.embed and start < len(state.prompt_token_ids):
            count = min(end, len(state.prompt_token_ids)) - start
            self.pool_rows.append((request_id, first, start, count))
        self.token_ids.extend(drafts)
        self.spans.append(RowSpan(request_id, first, start, num_new))
        state.verifying = bool(drafts)
        self.starts.append(start)
        self.counts.append(num_new)
        self.lora_ids.append(state.lora_id)
        self.long_rows.append(state.long_rope)
        state.num_computed_tokens = start + num_new
        if end == state.num_tokens:  # reached the end: sample the next (after each draft)
            if drafts:
                self.drafts[len(self.sample_ids)] = drafts
            last_own = first + end - start - 1
            for ahead in range(len(drafts) + 1):
                self.sample_ids.append(request_id)
                self.sample_rows.append(last_own + ahead)
                self.sample_ahead.append(ahead)


def needs_collected_tokens(
    plan: SchedulerOutput, requests: dict[str, RequestState], in_flight: Sequence[InFlightStep]
) -> bool:
    """Whether a row of `plan` needs a token that is still in flight here and that no
    placeholder can read: the row verifies drafts or follows a row that did, or a token of
    it was sampled by a step before the last launched (whose sampled ids are overwritten:
    a rank behind rank 0, with two steps in flight when the plan comes). The steps are then
    finished before the row is laid out."""
    last_launched = in_flight[-1].step if in_flight else -1
    return any(
        state.num_pending
        and (
            state.num_pending > 1
            or state.verifying
            or rid in plan.spec_token_ids
            or state.sample_step != last_launched
        )
        for rid in plan.num_scheduled_tokens
        if (state := requests.get(rid)) is not None
    )
