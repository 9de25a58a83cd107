"""Speculative decoding changes no output: the same tokens, greedy or seeded, as without it,
on tiny random Llama and Qwen3 models, under the engine settings that move KV around.

Random weights seldom repeat their prompt, so the n-gram proposer's drafts are mostly wrong
here (its acceptance on real text is measured on the embedded model). To make rows accept
0..k drafts at every position, `KnownDrafts` also proposes the tokens a run without
speculation produced, one draft in three spoiled: verification, the KV it leaves behind and
the scheduler's accounting are the real ones either way.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch

from kvflow import LLM, GenerationResult, SamplingParams
from shared.protocol import EngineRequest
from tests import quantized_writers
from tests.integration.tiny_models import TINY_ENGINE, make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
NGRAM_ONE = {**NGRAM, "prompt_lookup_min": 1}
# The suffix method with its recent outputs: the second pass of a test finds the first's.
METHODS = {"ngram": NGRAM_ONE, "suffix": {"method": "suffix", "num_speculative_tokens": 4}}
VARIANTS = {
    "default": {},
    "no prefix cache": dict(enable_prefix_caching=False),
    "chunked prefill 16": dict(max_num_batched_tokens=16),
    "small pool": dict(num_gpu_blocks_override=12, block_size=16),
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
MIXED = [
    GREEDY,
    SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=30, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=1.0, seed=5, min_tokens=12, max_tokens=40, top_k=20),
    SamplingParams(temperature=0.0, max_tokens=30, repetition_penalty=1.3),
    SamplingParams(temperature=0.9, seed=7, max_tokens=30, presence_penalty=0.8, logprobs=1),
]


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)

    def draw(n: int) -> list[int]:
        return torch.randint(3, 200, (n,), generator=generator).tolist()

    motif = draw(9)
    return [motif * 3, draw(30), motif + draw(5) + motif, draw(7), draw(50)]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param)
    make_tiny_model(request.param).save_pretrained(path)
    return Path(path)


def generate(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    return [r.token_ids for r in llm.generate(prompts(), params)]


class KnownDrafts:
    """Proposes what a run without speculation generated after the tokens so far, spoiling
    one draft in three (at a random position)."""

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def __init__(
        self, expected: list[list[int]], num: int, prompt_list: list[list[int]] | None = None
    ) -> None:
        pairs = zip(prompt_list or prompts(), expected, strict=True)
        self.sequences = [p + out for p, out in pairs]
        self.num = num
        self.random = random.Random(0)

    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        drafts = {}
        for request_id, tokens in dict(requests).items():
            # None where the run has left the known tokens (a bf16 near-tie on a GPU).
            whole = next((s for s in self.sequences if s[: len(tokens)] == tokens), [])
            ids = whole[len(tokens) : len(tokens) + self.num]
            if ids and self.random.random() < 1 / 3:
                ids[self.random.randrange(len(ids))] += 1
            if ids:
                drafts[request_id] = ids
        return drafts


def speculating(folder: Path, spec: dict, **settings: object) -> LLM:
    return LLM(str(folder), **TINY_ENGINE, speculative_config=spec, **settings)


@pytest.fixture(scope="module")
def greedy_expected(folder: Path) -> list[list[int]]:
    """Greedy tokens without speculation (the same under every engine setting: the parity
    tests hold them to transformers')."""
    return generate(LLM(str(folder), **TINY_ENGINE), GREEDY)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_greedy_output_is_unchanged_by_drafts(
    folder: Path, greedy_expected: list[list[int]], variant: str, method: str
) -> None:
    settings = VARIANTS[variant]
    expected = greedy_expected
    llm = speculating(folder, METHODS[method], **settings)
    assert generate(llm, GREEDY) == expected
    assert generate(llm, GREEDY) == expected  # again, from the prefix cache where it is on
    stats = llm.engine.scheduler.spec_decode
    assert stats.num_drafts > 0
    llm.engine.scheduler.check_invariants()
    if variant == "small pool":
        assert llm.stats().num_preemptions > 0


@pytest.mark.parametrize("variant", ["default", "small pool", "chunked prefill 16"])
def test_accepted_drafts_give_the_same_tokens_and_logprobs(folder: Path, variant: str) -> None:
    settings = VARIANTS[variant]
    plain = LLM(str(folder), **TINY_ENGINE, **settings)
    expected = plain.generate(prompts(), MIXED)
    llm = speculating(folder, NGRAM, **settings)
    llm.runner.proposer = KnownDrafts([r.token_ids for r in expected], 4)  # type: ignore[assignment]
    got = llm.generate(prompts(), MIXED)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for mine, theirs in zip(got, expected, strict=True):
        pairs = zip(mine.outputs[0].logprobs, theirs.outputs[0].logprobs, strict=True)
        for a, b in pairs:
            assert (a.token_id, a.rank) == (b.token_id, b.rank)
            assert abs(a.logprob - b.logprob) < 1e-4
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
    stats = llm.engine.scheduler.spec_decode
    # Most rows accept several drafts: every position is exercised.
    assert stats.mean_acceptance_length > 2.0
    assert all(stats.accepted_per_position)
    llm.engine.scheduler.check_invariants()


class FixedDrafts:
    """After `prefix` + one sampled token `after`, proposes `drafts`; nothing elsewhere."""

    def __init__(self, prefix: list[int], after: int, drafts: list[int]) -> None:
        self.sequence, self.drafts = [*prefix, after], drafts

    def finished(self, request_id: str, output_token_ids: list[int]) -> None:
        pass

    def reset(self) -> None:
        pass

    def propose_batch(self, requests: Iterable[tuple[str, list[int]]]) -> dict[str, list[int]]:
        return {
            rid: self.drafts for rid, tokens in dict(requests).items() if tokens == self.sequence
        }


def top_k_probs(model: torch.nn.Module, tokens: list[int], k: int) -> dict[int, float]:
    """The next token's distribution at temperature 1 under top_k = k."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    values, ids = logits.topk(k)
    return dict(zip(ids.tolist(), values.softmax(dim=-1).tolist(), strict=True))


def chi_square_p(counts: dict[int, int], probs: dict[int, float]) -> float:
    """The chance of counts at least this far from `probs` (Pearson's test)."""
    total = sum(counts.values())
    assert set(counts) <= set(probs), "a token outside the distribution was drawn"
    stat = sum((counts.get(t, 0) - total * p) ** 2 / (total * p) for t, p in probs.items())
    dof = torch.tensor((len(probs) - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, torch.tensor(stat / 2, dtype=torch.float64)))


def test_speculative_sampling_keeps_the_target_distribution(tmp_path: Path) -> None:
    """Unseeded draws at temperature 1, top_k 5: the tokens sampled where drafts were verified
    (at a draft's position, and after an accepted draft) follow the model's distributions
    there, by a chi-square test; and the test tells a wrong distribution apart."""
    model = make_tiny_model("llama")
    model.save_pretrained(tmp_path)
    prompt = prompts()[3]
    first = top_k_probs(model, prompt, 5)
    a = max(first, key=first.__getitem__)  # the likeliest first token: drafts follow it
    second = top_k_probs(model, [*prompt, a], 5)
    d2 = max(second, key=second.__getitem__)
    third = top_k_probs(model, [*prompt, a, d2], 5)
    # 64 rows at a time: each has room for 3 drafts (speculation.drafts_per_row).
    llm = speculating(tmp_path, NGRAM, max_num_seqs=64)
    llm.runner.proposer = FixedDrafts(prompt, a, [d2, 999 % 256])  # type: ignore[assignment]
    params = SamplingParams(temperature=1.0, top_k=5, max_tokens=3, ignore_eos=True)
    outputs = [r.token_ids for r in llm.generate([prompt] * 3000, params)]
    after_a = [out for out in outputs if out[0] == a]
    after_d2 = [out for out in after_a if out[1] == d2]
    counts_2 = {t: sum(out[1] == t for out in after_a) for t in {o[1] for o in after_a}}
    counts_3 = {t: sum(out[2] == t for out in after_d2) for t in {o[2] for o in after_d2}}
    assert len(after_a) > 500 and len(after_d2) > 200
    assert llm.engine.scheduler.spec_decode.num_accepted_tokens >= len(after_d2)
    # Fixed seeds: the same draws every run (p = 0.07 and 0.62 on 2026-12-02).
    assert chi_square_p(counts_2, second) > 1e-3
    assert chi_square_p(counts_3, third) > 1e-3
    # The test's power: the same counts fail against the distribution with its likeliest and
    # least likely tokens' chances swapped.
    order = sorted(second, key=second.__getitem__)
    swapped = {**second, order[0]: second[order[-1]], order[-1]: second[order[0]]}
    assert chi_square_p(counts_2, swapped) < 1e-6


def test_drafts_under_a_grammar_keep_the_same_valid_outputs(tool_chat_model_dir: Path) -> None:
    """A JSON Schema's rows verify the drafts their grammar allows, each position sampled
    under the grammar's state after the drafts before it: the same texts as without (greedy
    and seeded), every one valid."""
    from shared.protocol import StructuredOutput
    from tests.integration.test_structured_output import PROMPTS, SMALL_SCHEMA, constrained

    spec = StructuredOutput(json=json.dumps(SMALL_SCHEMA))
    params = [constrained(spec, seed, max_tokens=120) for seed in (None, 1, 2, None)]
    settings = dict(**TINY_ENGINE, max_model_len=1024)
    expected = LLM(str(tool_chat_model_dir), **settings).generate(PROMPTS, params)
    llm = LLM(str(tool_chat_model_dir), speculative_config=NGRAM, **settings)
    llm.runner.proposer = KnownDrafts(  # type: ignore[assignment]
        [r.token_ids for r in expected], 4, [r.prompt_token_ids for r in expected]
    )
    got = llm.generate(PROMPTS, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in expected]
    for result in got:
        assert result.finish_reason == "stop"
        assert set(json.loads(result.text)) == set(SMALL_SCHEMA["properties"])
    assert llm.engine.scheduler.spec_decode.mean_acceptance_length > 2.0


def test_a_rank_behind_on_collecting_takes_the_next_plan(folder: Path) -> None:
    """Tensor-parallel ranks 1..N-1 run rank 0's plans and collect their steps when they
    like: the plan that follows a verifying step may reach one before it has collected that
    step (rank 0's scheduler made the plan after its own collect). A second runner here takes
    each plan before collecting the step before, and samples what the first one does."""
    expected = LLM(str(folder), **TINY_ENGINE).generate(prompts(), GREEDY)
    leader = speculating(folder, NGRAM)
    leader.runner.proposer = KnownDrafts([r.token_ids for r in expected], 4)  # type: ignore[assignment]
    follower = speculating(folder, NGRAM).runner
    follower.proposer = None  # as on a rank after the first: it reads rank 0's drafts in plans
    scheduler = leader.engine.scheduler
    for i, prompt in enumerate(prompts()):
        request = EngineRequest(request_id=str(i), prompt_token_ids=prompt, sampling_params=GREEDY)
        scheduler.add_request(request)
    leads, follows = [], []
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        output = leader.runner.execute(plan)
        follower.submit(plan)
        if follower.num_in_flight > 1:
            follows.append(follower.collect().sampled)
        leads.append(output.sampled)
        scheduler.update(plan, output)
    follows.append(follower.collect().sampled)
    assert follows == leads
    assert scheduler.spec_decode.num_accepted_tokens > 0


def tokens_agreed_to_a_near_tie(got: list[GenerationResult], plain: list[GenerationResult]) -> int:
    """Tokens that agree before each pair of outputs first differs; where they differ, each
    side's token must be among the other's top logprobs (the rule for bf16 and W8A8, whose
    rounding can flip a near tie)."""
    agreed = 0
    for mine, theirs in zip(got, plain, strict=True):
        pairs = enumerate(zip(mine.token_ids, theirs.token_ids, strict=True))
        same = next((i for i, (a, b) in pairs if a != b), len(mine.token_ids))
        if same < len(mine.token_ids):
            my_top = {t.token_id for t in mine.outputs[0].logprobs[same].top}
            their_top = {t.token_id for t in theirs.outputs[0].logprobs[same].top}
            assert mine.token_ids[same] in their_top and theirs.token_ids[same] in my_top
        agreed += same
    return agreed


class NoDrafts(KnownDrafts):
    """Proposes nothing: every speculating request backs off into the pipelined loop."""

    def __init__(self) -> None:
        super().__init__([[] for _ in prompts()], 0)


def test_a_rank_two_steps_behind_lays_out_pipelined_rows_as_rank_0(folder: Path) -> None:
    """A rank that has two steps in flight when the next plan comes (rank 0 collected the
    older one before planning) finishes them before it lays out a row whose token is one of
    theirs, rather than read a placeholder from a step whose sampled ids were overwritten.
    Rank 0 runs the pipelined loop here, with requests backed off (no drafts) and admitted at
    different steps."""
    leader = speculating(folder, NGRAM)
    leader.runner.proposer = NoDrafts()  # type: ignore[assignment]
    follower = speculating(folder, NGRAM).runner
    follower.proposer = None  # as on a rank after the first: it reads rank 0's drafts in plans
    scheduler = leader.engine.scheduler
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    leads, follows, last = {}, {}, None
    for step in range(200):
        if step < 2:
            request = EngineRequest(
                request_id=str(step), prompt_token_ids=prompts()[step], sampling_params=params
            )
            scheduler.add_request(request)
        if not scheduler.has_unfinished():
            break
        plan = scheduler.schedule()
        leader.runner.submit(plan)
        follower.prepare(plan)  # with its last two steps in flight
        while follower.num_in_flight > 1:
            output = follower.collect()
            follows[output.step] = output.sampled
        follower.launch(plan.step)
        if last is not None:
            output = leader.runner.collect()
            leads[output.step] = output.sampled
            scheduler.update(last, output)
        last = plan
    while follower.num_in_flight:
        output = follower.collect()
        follows[output.step] = output.sampled
    assert leads and all(follows[step] == sampled for step, sampled in leads.items())


QUANTIZED = {
    "fp8": lambda model, path: quantized_writers.write_fp8(model, path, per_tensor=False),
    "awq": lambda model, path: quantized_writers.write_awq(model, path, group_size=32),
}


@pytest.mark.parametrize("fmt", sorted(QUANTIZED))
def test_quantized_checkpoints_speculate_without_changing_their_output(
    fmt: str, tmp_path: Path
) -> None:
    """FP8 W8A8 and int4 (AWQ) layers verify drafts: a verifying row's extra positions go
    through the quantized GEMMs at more rows than a decode's. Int4 weights change nothing:
    the same tokens. FP8 W8A8 quantizes each layer's input to a coarse grid, where float32's
    last-bit differences between a GEMM of 5 rows and one of 25 can cross a step and flip a
    near tie (test_quantized_parity): each output agrees until its first difference, and
    there each token is among the other's top 5."""
    QUANTIZED[fmt](make_tiny_model("llama"), tmp_path)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=5)
    plain = LLM(str(tmp_path), **TINY_ENGINE).generate(prompts(), params)
    llm = speculating(tmp_path, NGRAM)
    llm.runner.proposer = KnownDrafts([r.token_ids for r in plain], 4)  # type: ignore[assignment]
    got = llm.generate(prompts(), params)
    if fmt == "awq":
        assert [r.token_ids for r in got] == [r.token_ids for r in plain]
    assert tokens_agreed_to_a_near_tie(got, plain) >= len(plain) * 48 // 2
    assert llm.engine.scheduler.spec_decode.mean_acceptance_length > 1.5


def test_parallel_samples_draw_for_draw_as_without_speculation(folder: Path) -> None:
    """n > 1: each of a request's samples speculates on its own tokens, and its seeded draws
    are those it makes without speculation."""
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    plain = LLM(str(folder), **TINY_ENGINE).generate(prompts(), params)
    got = speculating(folder, NGRAM_ONE).generate(prompts(), params)
    for mine, theirs in zip(got, plain, strict=True):
        assert [o.token_ids for o in mine.outputs] == [o.token_ids for o in theirs.outputs]
