"""Turn one step's logits into one token per request, as batched tensor ops (vLLM semantics).

    raw logits ──> raw logprobs (what the user sees in `logprobs`)
        └─> grammar bitmask ─> logit_bias, min_tokens masks
              ─> repetition / frequency / presence penalties
              ├─> greedy rows: argmax
              └─> other rows: / temperature ─> top_k ─> top_p ─> min_p ─> exponential race

Per-row parameters become tensors once per step (`SamplingTensors`); everything after that is
a pure function of (logits, tensors), so tests can check each stage on its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import ops
from shared.protocol import SamplingParams, TokenLogprobs

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One request's row in the batch."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens generated so far (the next one is being sampled)
    # Generated tokens still in flight, not in output_token_ids yet. NOTE: only rows without
    # penalties may have any: penalties read the tokens themselves, counts are enough elsewhere.
    num_pending: int = 0

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one sampled id per row
    logprobs: list[TokenLogprobs | None]  # per row; None where params.logprobs is None


@dataclass
class Penalties:
    repetition: torch.Tensor  # [R] float32; 1.0 = off
    frequency: torch.Tensor  # [R] float32; 0.0 = off
    presence: torch.Tensor  # [R] float32; 0.0 = off
    seen: torch.Tensor  # [R, V] bool: token occurs in the prompt or the output
    output_counts: torch.Tensor  # [R, V] float32: occurrences in the output


TokenBitmask = tuple[torch.Tensor, torch.Tensor]


@dataclass
class SamplingTensors:
    """One step's per-row parameters. A feature no row uses is None, so its op is skipped."""

    greedy: torch.Tensor  # [R] bool
    all_greedy: bool  # a Python bool, so the common all-greedy case needs no device sync
    temperature: torch.Tensor  # [R] float32; 1.0 on greedy rows so the division is harmless
    top_k: torch.Tensor | None  # [R] int64; vocab_size keeps all
    top_p: torch.Tensor | None  # [R] float32; 1.0 keeps all
    min_p: torch.Tensor | None  # [R] float32; 0.0 keeps all
    additions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, value) [A]
    penalties: Penalties | None
    seeds: list[tuple[int, int]]  # (row, generator seed) for sampled rows with params.seed
    num_logprobs: list[int | None]  # params.logprobs per row
    # Structured output: (rows [G] int64, bitmask [G, W] int32) for the constrained rows.
    token_bitmask: TokenBitmask | None = None

    @property
    def max_num_logprobs(self) -> int | None:
        return max((n for n in self.num_logprobs if n is not None), default=None)


def step_seed(seed: int, step: int) -> int:
    """Generator seed for a request's `step`-th output token.

    A pure function of (seed, step), not a counter: the draw is the same whatever else is in
    the batch, and again when a preempted request is recomputed.
    """
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


def _splitmix64(x: int) -> int:
    # Why: nearby seeds/steps must give unrelated streams; plain seed + step would collide.
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on the device without waiting for the device.

    Why pinned: a copy from pageable memory waits for all work queued before it, which would
    stall the host behind the step in flight that it is meant to overlap.
    """
    pinned = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=pinned).to(device, non_blocking=pinned)


def build_sampling_tensors(
    rows: list[SamplingRow],
    vocab_size: int,
    eos_token_ids: tuple[int, ...],
    device: torch.device,
    token_bitmask: TokenBitmask | None = None,
) -> SamplingTensors:
    params = [row.params for row in rows]
    # Why greedy rows get neutral values: argmax ignores temperature and the filters.
    temperature = [1.0 if p.greedy else p.temperature for p in params]
    top_k = [
        vocab_size if p.greedy or p.top_k is None else min(p.top_k, vocab_size) for p in params
    ]
    top_p = [1.0 if p.greedy else p.top_p for p in params]
    min_p = [0.0 if p.greedy else p.min_p for p in params]
    return SamplingTensors(
        greedy=to_device([p.greedy for p in params], torch.bool, device),
        all_greedy=all(p.greedy for p in params),
        temperature=to_device(temperature, torch.float32, device),
        top_k=_unless_neutral(top_k, vocab_size, torch.int64, device),
        top_p=_unless_neutral(top_p, 1.0, torch.float32, device),
        min_p=_unless_neutral(min_p, 0.0, torch.float32, device),
        additions=_additions(rows, eos_token_ids, device),
        penalties=_penalties(rows, vocab_size, device),
        seeds=[
            (i, step_seed(row.params.seed, row.num_output_tokens))
            for i, row in enumerate(rows)
            if row.params.seed is not None and not row.params.greedy
        ],
        num_logprobs=[p.logprobs for p in params],
        token_bitmask=token_bitmask,
    )


def _unless_neutral(
    values: list[float] | list[int], neutral: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    if all(v == neutral for v in values):
        return None
    return to_device(values, dtype, device)  # [R]


def _additions(
    rows: list[SamplingRow], eos_token_ids: tuple[int, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """logit_bias and the min_tokens mask as one sparse add: -inf + bias is still -inf."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        p = row.params
        adds = dict(p.logit_bias or {})
        if row.num_output_tokens < p.min_tokens:
            # Why not EOS under ignore_eos: it is then no stop token, so nothing to hold back.
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            adds.update(dict.fromkeys(stops, float("-inf")))
        row_ids += [i] * len(adds)
        token_ids += adds.keys()
        values += adds.values()
    if not row_ids:
        return None
    return (
        to_device(row_ids, torch.int64, device),
        to_device(token_ids, torch.int64, device),
        to_device(values, torch.float32, device),
    )  # [A] each


def _penalties(rows: list[SamplingRow], vocab_size: int, device: torch.device) -> Penalties | None:
    params = [row.params for row in rows]
    on = [p.has_penalties for p in params]
    if not any(on):
        return None
    # Why empty lists for rows without penalties: their neutral values ignore the counts anyway.
    prompts = [row.prompt_token_ids if o else [] for row, o in zip(rows, on, strict=True)]
    outputs = [row.output_token_ids if o else [] for row, o in zip(rows, on, strict=True)]
    output_counts = _token_counts(outputs, vocab_size, device)  # [R, V]
    seen = (_token_counts(prompts, vocab_size, device) > 0) | (output_counts > 0)  # [R, V]
    values = [[p.repetition_penalty, p.frequency_penalty, p.presence_penalty] for p in params]
    repetition, frequency, presence = to_device(values, torch.float32, device).unbind(dim=1)
    return Penalties(repetition, frequency, presence, seen, output_counts)


def _token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device
) -> torch.Tensor:
    width = max(map(len, token_ids), default=0)
    # Why pad with vocab_size: padding lands in an extra column that is sliced off.
    padded = [ids + [vocab_size] * (width - len(ids)) for ids in token_ids]
    index = to_device(padded, torch.int64, device)  # [R, width]
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)  # [R, V + 1]
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]  # [R, V]


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """The grammar's bitmask, logit_bias, min_tokens, then penalties on float32 `logits` [R, V]
    (modified in place)."""
    if t.token_bitmask is not None:
        apply_token_bitmask(logits, *t.token_bitmask)
    if t.additions is not None:
        logits.index_put_(t.additions[:2], t.additions[2], accumulate=True)
    if t.penalties is not None:
        logits = apply_penalties(logits, t.penalties)
    return logits


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Tokens a row's bitmask [W] int32 does not allow get -inf, in `logits` [R, V] rows `rows`."""
    allowed = unpack_bits(bitmask)[:, : logits.shape[1]]  # [G, V] bool
    if allowed.shape[1] < logits.shape[1]:  # the mask covers the tokenizer, not padded columns
        allowed = torch.nn.functional.pad(allowed, (0, logits.shape[1] - allowed.shape[1]))
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def unpack_bits(bitmask: torch.Tensor) -> torch.Tensor:
    """[G, W] int32 as [G, 32 W] bool: bit j of word w says whether token 32 w + j is allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> shifts) & 1).bool().flatten(1)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    repetition = torch.where(p.seen, p.repetition[:, None], 1.0)  # [R, V]
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)  # [R, V]
    logits -= p.frequency[:, None] * p.output_counts
    logits -= p.presence[:, None] * (p.output_counts > 0)
    return logits


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Temperature, top_k, top_p, min_p; returns probs [R, V], filtered tokens at 0.

    Rows are not renormalized after min_p: the exponential race is blind to a row's scale.
    """
    logits = logits / t.temperature[:, None]  # [R, V]
    if t.top_k is not None or t.top_p is not None:
        logits = apply_top_k_top_p(logits, t.top_k, t.top_p)
    probs = logits.softmax(dim=-1)  # [R, V]
    if t.min_p is not None:
        threshold = t.min_p[:, None] * probs.amax(dim=-1, keepdim=True)  # [R, 1]
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """One ascending sort serves both filters; excluded logits become -inf (vLLM's method)."""
    sorted_logits, order = logits.sort(dim=-1)  # [R, V] ascending
    if top_k is not None:
        kth = sorted_logits.gather(1, (logits.shape[1] - top_k)[:, None])  # [R, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
        # Drop the longest low tail whose mass is <= 1 - top_p; always keep the top token.
        drop = cumulative <= 1.0 - top_p[:, None]  # [R, V]
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)  # [R, V] back in vocab order


def logprob_tensors(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, max_k: int
) -> tuple[torch.Tensor, ...]:
    """Per row: the sampled token's raw logprob [R], its rank [R], top ids and values [R, k]."""
    sampled = raw_logprobs.gather(1, token_ids[:, None])[:, 0]  # [R]
    ranks = (raw_logprobs > sampled[:, None]).sum(dim=-1) + 1  # [R]
    top_values, top_ids = raw_logprobs.topk(max_k, dim=-1)  # [R, max_k] descending
    return sampled, ranks, top_ids, top_values


def to_token_logprobs(
    columns: list[list], token_list: list[int], num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """The host lists of `logprob_tensors` as one TokenLogprobs per row that asked."""
    return [
        None if k is None else TokenLogprobs(token, logprob, rank, ids[:k], values[:k])
        for k, token, logprob, rank, ids, values in zip(
            num_logprobs, token_list, *columns, strict=True
        )
    ]


class PendingSample:
    """Sampled ids on their way to the host; `result()` is the one wait of a step.

    The copies start at once (into pinned memory, on the device's queue), and an event marks
    their end, so `result()` waits for this step only, not for steps queued after it.
    """

    def __init__(
        self,
        token_ids: torch.Tensor | None,  # [R]
        logprobs: tuple[torch.Tensor, ...] | None = None,  # logprob_tensors(...)
        num_logprobs: list[int | None] | None = None,
    ) -> None:
        self.token_ids = token_ids
        self.num_logprobs = num_logprobs or []
        tensors = [t for t in (token_ids, *(logprobs or ())) if t is not None]
        on_cuda = bool(tensors) and tensors[0].is_cuda
        self._host = [t.to("cpu", non_blocking=on_cuda) for t in tensors]
        self._ready: torch.cuda.Event | None = None
        if on_cuda:
            self._ready = torch.cuda.Event()
            self._ready.record()

    @property
    def ready(self) -> bool:
        """Whether `result()` would return without waiting."""
        return self._ready is None or self._ready.query()

    def result(self) -> SamplerOutput:
        if self.token_ids is None:
            return SamplerOutput(token_ids=[], logprobs=[])
        if self._ready is not None:
            self._ready.synchronize()
        token_list, *columns = (t.tolist() for t in self._host)
        if not columns:
            return SamplerOutput(token_list, [None] * len(token_list))
        return SamplerOutput(token_list, to_token_logprobs(columns, token_list, self.num_logprobs))


def _plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that changes the argmax or asks for logprobs."""
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and not p.logit_bias
        and row.num_output_tokens >= p.min_tokens
        and not p.has_penalties
        and p.structured_output is None
    )


class Sampler:
    def __init__(
        self, vocab_size: int, eos_token_ids: tuple[int, ...], device: torch.device, seed: int = 0
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device=device)  # draws for rows without params.seed
        self.generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: TokenBitmask | None = None,
    ) -> SamplerOutput:
        return self.sample(logits, rows, token_bitmask).result()

    def sample(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        token_bitmask: TokenBitmask | None = None,
    ) -> PendingSample:
        """Queue the sampling on the device; `result()` then waits for it.

        `token_bitmask`: the structured-output rows and their allowed tokens, if any.
        """
        if not rows:
            return PendingSample(None)
        if all(_plain_greedy(row) for row in rows):
            # The common offline case: one argmax, no per-row tensors to build and upload.
            return PendingSample(ops.argmax(logits[:, : self.vocab_size]))
        t = build_sampling_tensors(
            rows, self.vocab_size, self.eos_token_ids, self.device, token_bitmask
        )
        # Why slice and copy: a padded lm_head may add columns; processing below is in place.
        logits = logits[:, : self.vocab_size].to(torch.float32, copy=True)  # [R, V]
        max_k = t.max_num_logprobs
        # The raw distribution, before any processing, is what `logprobs` reports.
        raw_logprobs = logits.log_softmax(dim=-1) if max_k is not None else None  # [R, V]
        logits = process_logits(logits, t)
        token_ids = self._sample(logits, t)  # [R]
        if raw_logprobs is None or max_k is None:
            return PendingSample(token_ids)
        parts = logprob_tensors(raw_logprobs, token_ids, max_k)
        return PendingSample(token_ids, parts, t.num_logprobs)

    def _sample(self, logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
        greedy_ids = ops.argmax(logits)  # [R]
        if t.all_greedy:
            return greedy_ids
        probs = filtered_probs(logits, t)  # [R, V]
        # Exponential race: argmax(p / q), q ~ Exp(1), picks i with probability p_i / sum(p).
        random_ids = (probs / self._exponentials(probs, t.seeds)).argmax(dim=-1)  # [R]
        return torch.where(t.greedy, greedy_ids, random_ids)

    def _exponentials(self, like: torch.Tensor, seeds: list[tuple[int, int]]) -> torch.Tensor:
        q = torch.empty_like(like).exponential_(generator=self.generator)  # [R, V]
        for row, seed in seeds:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            # Why a fresh [V] tensor: the draw then depends on nothing but the seed.
            q[row] = torch.empty(like.shape[1], device=self.device).exponential_(
                generator=generator
            )
        # Why clamp: q == 0 would make 0 / 0 = NaN, and argmax picks NaN.
        return q.clamp_(min=torch.finfo(q.dtype).tiny)
