"""Sampler: greedy, per-request seeds, sampled distributions, filters, penalties, min_tokens
and logprobs, checked against plain per-row references on small vocabularies."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from services.executor.runner.sampler import (
    Sampler,
    SamplingRow,
    build_sampling_tensors,
    filtered_probs,
    process_logits,
    step_seed,
)
from shared.protocol import SamplingParams

VOCAB = 64
EOS = 63
CPU = torch.device("cpu")
NUM_DRAWS = 2000  # per distribution check: every p here is < 0.3, so sigma < 0.0103


def random_logits(num_rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return 2.0 * torch.randn(num_rows, vocab, generator=generator)  # [R, V]


def row(prompt: list[int] | None = None, output: list[int] | None = None, **kw: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**kw), prompt or [], output or [])


def processed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    tensors = build_sampling_tensors(rows, logits.shape[1], (EOS,), CPU)
    return process_logits(logits.clone(), tensors)  # [R, V]


def frequencies(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double() / len(token_ids)


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Plain one-row reference: temperature, top_k, nucleus, min_p, renormalized. [V] float64."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1)  # [V]
    order = probs.argsort(descending=True).tolist()
    kept = order[: p.top_k] if p.top_k is not None else order
    total = probs[kept].sum().item()
    nucleus, mass = [], 0.0
    for token in kept:  # smallest prefix whose (top_k renormalized) mass reaches top_p
        nucleus.append(token)
        mass += probs[token].item() / total
        if mass >= p.top_p:
            break
    out = torch.zeros_like(probs)
    out[nucleus] = probs[nucleus]
    out[out < p.min_p * out.max()] = 0.0
    return out / out.sum()


# Designed so every filter boundary has a clear margin: p_i is proportional to 16 - i.
DESIGNED = torch.log(torch.arange(16, 0, -1, dtype=torch.float32))[None, :]  # [1, 16]
FILTER_CASES = [
    dict(temperature=1.0),
    dict(temperature=0.5),
    dict(temperature=2.0),
    dict(top_k=4),  # tokens 0..3
    dict(top_p=0.5),  # masses 0.43 after 4 tokens, 0.51 after 5: tokens 0..4
    dict(min_p=0.8),  # 13 >= 0.8 * 16 > 12: tokens 0..3
    # top_p acts on the top_k survivors renormalized: 5 tokens (on the full softmax, 7).
    dict(temperature=0.7, top_k=8, top_p=0.7, min_p=0.2),
    dict(temperature=0.7, top_k=8, min_p=0.7),  # min_p binds after top_k: tokens 0..3
]


# ------------------------------------------------------------------------------ greedy


def test_greedy_is_argmax_for_float32_and_bf16() -> None:
    logits = random_logits(8)
    sampler = Sampler(VOCAB, (EOS,), CPU)
    rows = [row(temperature=0.0) for _ in range(8)]
    assert sampler(logits, rows).token_ids == logits.argmax(dim=-1).tolist()
    bf16 = logits.bfloat16()
    assert sampler(bf16, rows).token_ids == bf16.float().argmax(dim=-1).tolist()


def test_top_k_1_equals_greedy_and_greedy_rows_ignore_sampled_neighbours() -> None:
    logits = random_logits(8, seed=1)
    rows = [row(top_k=1) if i % 2 else row(temperature=0.0) for i in range(8)]
    expected = logits.argmax(dim=-1).tolist()
    for seed in range(3):
        assert Sampler(VOCAB, (EOS,), CPU, seed)(logits, rows).token_ids == expected


def test_inputs_are_left_untouched_and_padded_vocab_is_ignored() -> None:
    logits = random_logits(4, vocab=VOCAB + 8)  # a padded lm_head: 8 extra columns
    logits[:, VOCAB:] = 1e4
    before = logits.clone()
    rows = [row(repetition_penalty=2.0, prompt=[1, 2], logit_bias={3: 5.0}) for _ in range(4)]
    token_ids = Sampler(VOCAB, (EOS,), CPU)(logits, rows).token_ids
    assert all(0 <= t < VOCAB for t in token_ids)
    torch.testing.assert_close(logits, before)
    assert Sampler(VOCAB, (EOS,), CPU)(logits, []).token_ids == []


# ------------------------------------------------------------------------------ seeds


def test_seeded_row_is_the_same_alone_and_in_any_batch() -> None:
    for seed in range(20):
        target = random_logits(1, seed=100 + seed)  # [1, V]
        alone = Sampler(VOCAB, (EOS,), CPU, seed=0)(
            target, [row(seed=seed, output=[1] * 5)]
        ).token_ids[0]
        others = random_logits(4, seed=seed)  # [4, V]
        logits = torch.cat([others[:2], target, others[2:]])  # [5, V]
        rows = [
            row(),
            row(seed=seed + 1, output=[1] * 5),
            row(seed=seed, output=[2] * 5),  # same seed and length; content does not matter
            row(temperature=0.0),
            row(seed=seed, output=[1] * 3),  # same seed, another step
        ]
        batched = Sampler(VOCAB, (EOS,), CPU, seed=7)(logits, rows).token_ids[2]
        assert batched == alone


def test_seeded_draws_vary_with_seed_and_step() -> None:
    logits = torch.zeros(200, VOCAB)  # uniform: the token is the draw alone
    sampler = Sampler(VOCAB, (EOS,), CPU)
    by_seed = sampler(logits, [row(seed=s) for s in range(200)]).token_ids
    by_step = sampler(logits, [row(seed=5, output=[0] * n) for n in range(200)]).token_ids
    # 200 uniform draws from 64 tokens cover ~61 distinct ones.
    assert len(set(by_seed)) > 50
    assert len(set(by_step)) > 50
    assert step_seed(5, 3) == step_seed(5, 3) != step_seed(5, 4) != step_seed(6, 3)


# ------------------------------------------------------------------------ distributions


@pytest.mark.parametrize("case", FILTER_CASES)
def test_filtered_probs_match_the_reference_row_by_row(case: dict[str, Any]) -> None:
    # Each row holds different logits and the batch mixes in default rows, so per-row
    # parameters must not leak across rows.
    logits = torch.cat([DESIGNED, random_logits(3, seed=3, vocab=16)])  # [4, 16]
    params = [SamplingParams(**case), SamplingParams(), SamplingParams(**case), SamplingParams()]
    rows = [SamplingRow(p, [], []) for p in params]
    tensors = build_sampling_tensors(rows, 16, (EOS,), CPU)
    probs = filtered_probs(logits.clone(), tensors)  # [4, 16]
    probs = probs / probs.sum(dim=-1, keepdim=True)
    for i, p in enumerate(params):
        expected = reference_probs(logits[i], p)
        assert torch.equal(probs[i] > 0, expected > 0)
        torch.testing.assert_close(probs[i].double(), expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("case", FILTER_CASES)
def test_sampled_frequencies_match_the_filtered_softmax(case: dict[str, Any], seeded: bool) -> None:
    rows = [row(seed=i if seeded else None, **case) for i in range(NUM_DRAWS)]
    token_ids = Sampler(16, (15,), CPU)(DESIGNED.expand(NUM_DRAWS, -1), rows).token_ids
    freq = frequencies(token_ids, 16)
    expected = reference_probs(DESIGNED[0], SamplingParams(**case))
    assert (freq[expected == 0] == 0).all(), "a filtered-out token was sampled"
    likely = expected > 10 / NUM_DRAWS  # expected 10+ times: missed with probability < e^-10
    assert (freq[likely] > 0).all(), "an allowed token was never sampled"
    assert (freq - expected).abs().max() < 0.04  # ~4 sigma; the seeds make it deterministic


def test_tiny_top_p_still_keeps_the_top_token() -> None:
    # In float32, 1 - 1e-9 == 1.0 and a row's cumulative mass may round to <= 1.0.
    logits = random_logits(100, seed=8)
    out = Sampler(VOCAB, (EOS,), CPU)(logits, [row(top_p=1e-9) for _ in range(100)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


# ---------------------------------------------------------------------------- penalties


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = random_logits(1)
    logits[0, 1], logits[0, 2] = 2.0, -1.0
    out = processed(logits, [row(prompt=[1], output=[2], repetition_penalty=2.0)])
    expected = logits.clone()
    expected[0, 1], expected[0, 2] = 1.0, -2.0  # seen in the prompt / in the output
    torch.testing.assert_close(out, expected)
    before, after = logits.softmax(dim=-1), out.softmax(dim=-1)
    assert after[0, 1] < before[0, 1] and after[0, 2] < before[0, 2]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = random_logits(2)
    rows = [
        row(prompt=[7], output=[3, 3, 5], frequency_penalty=0.5, presence_penalty=0.25),
        row(prompt=[7], output=[3, 3, 5]),  # no penalties: untouched
    ]
    out = processed(logits, rows)
    expected = logits.clone()
    expected[0, 3] -= 0.5 * 2 + 0.25
    expected[0, 5] -= 0.5 * 1 + 0.25
    torch.testing.assert_close(out, expected)


def test_repetition_applies_before_frequency_and_presence() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 3.0
    out = processed(
        logits,
        [row(output=[3], repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25)],
    )
    assert out[0, 3].item() == pytest.approx(3.0 / 1.5 - 0.5 - 0.25)


def test_logit_bias_forces_and_forbids_tokens() -> None:
    logits = random_logits(200, seed=4)
    sampler = Sampler(VOCAB, (EOS,), CPU)
    forced = sampler(logits, [row(logit_bias={5: 100.0}) for _ in range(200)]).token_ids
    assert set(forced) == {5}
    logits[:, 9] = 10.0  # token 9 holds nearly all the mass...
    forbidden = sampler(logits, [row(logit_bias={9: -100.0}) for _ in range(200)]).token_ids
    assert 9 not in forbidden  # ...until the bias removes it
    greedy = sampler(logits[:1], [row(temperature=0.0, logit_bias={9: -100.0})]).token_ids
    assert greedy != [9]


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 7] = 50.0, 40.0  # EOS first, stop token 7 second
    sampler = Sampler(VOCAB, (EOS,), CPU)

    def greedy(num_output: int, **kw: Any) -> int:
        rows = [row(output=[1] * num_output, temperature=0.0, min_tokens=3, **kw)]
        return sampler(logits, rows).token_ids[0]

    assert greedy(2, stop_token_ids=[7]) not in (EOS, 7)
    assert greedy(2) == 7  # not a stop token here
    assert greedy(3, stop_token_ids=[7]) == EOS
    assert greedy(2, stop_token_ids=[7], ignore_eos=True) == EOS  # EOS stops nothing
    out = processed(logits, [row(output=[1, 1], min_tokens=3, stop_token_ids=[7])])
    assert math.isinf(out[0, EOS].item()) and math.isinf(out[0, 7].item())
    sampled = sampler(logits.expand(500, -1), [row(min_tokens=1) for _ in range(500)]).token_ids
    assert EOS not in sampled


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = random_logits(5, seed=6)
    raw = torch.log_softmax(logits, dim=-1)  # [5, V]
    low = int(logits[0].argmin())
    rows = [
        row(logprobs=3, logit_bias={low: 100.0}),  # forced onto the least likely token
        row(logprobs=0, temperature=0.0),
        row(logprobs=20, repetition_penalty=1.3, output=[1, 2], temperature=0.8),
        row(),
        row(logprobs=5, top_k=3, seed=11),
    ]
    out = Sampler(VOCAB, (EOS,), CPU)(logits, rows)
    assert out.logprobs[3] is None
    assert out.token_ids[0] == low and out.logprobs[0] is not None
    assert out.logprobs[0].rank == VOCAB
    for i, r in enumerate(rows):
        lp = out.logprobs[i]
        if r.params.logprobs is None or lp is None:
            continue
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        values, ids = raw[i].topk(r.params.logprobs)
        assert lp.top_token_ids == ids.tolist()
        assert lp.top_logprobs == pytest.approx(values.tolist(), abs=1e-5)
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
    assert out.logprobs[1] is not None and out.logprobs[1].rank == 1
    assert out.logprobs[1].top_token_ids == []


def test_no_logprobs_when_none_asked() -> None:
    out = Sampler(VOCAB, (EOS,), CPU)(random_logits(3), [row(), row(temperature=0.0), row()])
    assert out.logprobs == [None, None, None]
    assert all(isinstance(t, int) for t in out.token_ids)
