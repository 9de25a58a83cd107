"""Speculative decoding's parts on their own: the --speculative-config reader, the n-gram
proposer, the acceptance rule, and the scheduler's lookahead and acceptance accounting."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.executor.runner.step_state import accepted
from services.executor.speculative.ngram import NgramProposer
from services.executor.speculative.suffix import SuffixProposer
from services.frontend.metrics.prometheus import Metrics
from services.scheduler.scheduler import Scheduler
from services.scheduler.speculation import drafts_per_row
from services.scheduler.stats_log import StatsLog
from shared.config import Config, ConfigError
from shared.protocol import ModelRunnerOutput, SamplingParams, SchedulerOutput
from shared.speculative import (
    SpeculativeConfig,
    SpeculativeConfigError,
    parse_speculative_config,
    speculates,
)
from tests.unit.scheduler_setup import EOS, add, make_scheduler
from tests.unit.snapshots import stats

# ------------------------------------------------------------------ the config


def test_ngram_config_takes_vllms_keys_and_defaults() -> None:
    def parse(**raw: object) -> SpeculativeConfig | None:
        return parse_speculative_config(json.dumps(raw))

    assert parse(method="ngram", num_speculative_tokens=3) == SpeculativeConfig("ngram", 3, 5, 5)
    assert parse(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4) == (
        SpeculativeConfig("ngram", 3, 4, 4)
    )
    assert parse(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2) == (
        SpeculativeConfig("ngram", 2, 2, 2)
    )
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ('{"method": "ngram"}', "num_speculative_tokens is required"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', ">= 1"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "not built yet"),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "EAGLE-3 head's folder"),
        (
            '{"method": "eagle3", "model": "h", "num_speculative_tokens": 3, "seed": 1}',
            "do not apply",
        ),
        ('{"model": "draft"}', "num_speculative_tokens is required"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', "model .* is required"),
        (
            '{"model": "d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
            "draft_tensor_parallel_size must be 1",
        ),
        ('{"model": "d", "num_speculative_tokens": 3, "prompt_lookup_max": 2}', "do not apply"),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "method must be one of"),
        ('{"method": "ngram", "num_speculative_tokens": 3, "model": "x"}', "do not apply"),
        (
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min must be <=",
        ),
        ("[1, 2]", "JSON object"),
        ("{nope", "not JSON"),
    ],
)
def test_a_config_that_cannot_run_is_refused_by_name(raw: str, says: str) -> None:
    with pytest.raises(SpeculativeConfigError, match=says):
        parse_speculative_config(raw)
    with pytest.raises(ConfigError, match="--speculative-config"):
        Config(speculative_config=raw)


def test_draft_model_config_takes_vllms_keys() -> None:
    raw = {"model": "/m/draft", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1}
    config = parse_speculative_config(json.dumps(raw))
    assert config == SpeculativeConfig("draft_model", 4, draft_model="/m/draft")
    assert config.lookahead == 4  # the draft writes the KV of its drafts but the last
    with_quant = parse_speculative_config(json.dumps({**raw, "quantization": "fp8"}))
    assert with_quant is not None and with_quant.draft_quantization == "fp8"
    ngram = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4}')
    assert ngram is not None and ngram.lookahead == 0
    eagle = parse_speculative_config(json.dumps({**raw, "method": "eagle3"}))
    assert eagle == SpeculativeConfig("eagle3", 4, draft_model="/m/draft")
    assert eagle.lookahead == 3  # the head's passes read the token after their position


def test_a_draft_models_rows_hold_blocks_for_the_next_proposal() -> None:
    scheduler = speculating_scheduler(num_lookahead_tokens=3, max_model_len=20)
    add(scheduler, "a", [10, 11, 12], max_tokens=16, ignore_eos=True)
    add(scheduler, "b", [10] * 14, max_tokens=6, ignore_eos=True)
    blocks = scheduler.kv.block_ids
    verify(scheduler, {"a": [50], "b": [70]}, {})
    assert (len(blocks["a"]), len(blocks["b"])) == (1, 4)  # prompts: no lookahead yet
    # a: 4 tokens, 3 draft slots and 3 lookahead slots past them (10, in 3 blocks of 4); b:
    # 15 tokens and 3 draft slots (18), its lookahead stopped at max_model_len (20).
    plan, got = verify(
        scheduler, {"a": [51, 52, 60, 61], "b": [71, 72]}, {"a": [51, 52, 53], "b": [71]}
    )
    assert plan.draft_slots == {"a": 3, "b": 3} and got == {"a": [51, 52, 60], "b": [71, 72]}
    assert (len(blocks["a"]), len(blocks["b"])) == (3, 5)
    # b: 17 tokens, 2 slots left by max_tokens and max_model_len: 19, and 20 with lookahead.
    plan, _ = verify(scheduler, {"a": [62], "b": [73]}, {})
    assert plan.draft_slots["b"] == 2 and len(blocks["b"]) == 5
    scheduler.check_invariants()


def test_lookahead_takes_only_blocks_no_row_needs() -> None:
    scheduler = speculating_scheduler(num_lookahead_tokens=3, num_blocks=3)
    add(scheduler, "a", [10, 11, 12], max_tokens=8, ignore_eos=True)
    add(scheduler, "b", [10, 11, 12, 13], max_tokens=8, ignore_eos=True)
    verify(scheduler, {"a": [50], "b": [70]}, {})
    # One block left: b's fifth token needs it; a's draft slots or lookahead would have taken
    # it first. b's draft slots fit in that block.
    plan, _ = verify(scheduler, {"a": [51], "b": [71]}, {})
    assert plan.num_scheduled_tokens == {"a": 1, "b": 4} and plan.draft_slots == {"b": 3}
    assert scheduler.num_preemptions == 0
    assert [len(scheduler.kv.block_ids[r]) for r in "ab"] == [1, 2]


def test_every_generating_request_speculates() -> None:
    assert speculates(SamplingParams(temperature=0.7, logprobs=2, min_tokens=3))
    assert speculates(SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5))
    assert not speculates(SamplingParams(embed=True, max_tokens=1))


# ------------------------------------------------------------------ the proposer


def proposer(num: int = 3, low: int = 1, high: int = 3) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", num, low, high))


def test_the_longest_ngram_is_tried_first_and_its_first_occurrence_taken() -> None:
    # "1 2 3" occurred at 0 (followed by 4 5 6); "3" alone also at 7 (followed by 9).
    assert proposer().propose("a", [1, 2, 3, 4, 5, 6, 3, 9, 1, 2, 3]) == [4, 5, 6]
    assert proposer(high=1).propose("a", [1, 2, 3, 4, 5, 6, 3, 9, 1, 2, 3]) == [4, 5, 6]
    assert proposer(num=5).propose("a", [7, 8, 7, 8]) == [7, 8]  # what follows, up to the end
    assert proposer(low=2).propose("a", [1, 2, 3, 4, 3]) == []  # only a 1-gram occurs
    assert proposer().propose("a", [5]) == []


def searched_drafts(tokens: list[int], num: int, low: int, high: int) -> list[int]:
    """Prompt lookup by searching the whole sequence: the index's reference."""
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        for start in range(len(tokens) - n):  # windows that end before the last token
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + num]
    return []


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(0, 3), max_size=60),
    st.lists(st.integers(1, 6), min_size=1, max_size=12),
    st.integers(1, 3),
    st.integers(0, 2),
)
def test_the_ngram_index_proposes_what_a_search_finds(
    tokens: list[int], cuts: list[int], low: int, extra: int
) -> None:
    """The sequence grows a few tokens at a time (the executor's list, appended to), and is
    proposed for after each; a sequence that does not extend the last is indexed afresh."""
    ngram = proposer(num=4, low=low, high=low + extra)
    grown: list[int] = []
    for cut in cuts:
        grown.extend(tokens[len(grown) : len(grown) + cut])
        assert ngram.propose("a", grown) == searched_drafts(grown, 4, low, low + extra)
    other = [9, *tokens[:10]]
    assert ngram.propose("a", other) == searched_drafts(other, 4, low, low + extra)
    ngram.finished("a", [])
    assert "a" not in ngram.indexes


def test_a_batch_proposes_once_per_request_and_leaves_out_empty_drafts() -> None:
    drafts = proposer().propose_batch([("a", [1, 2, 1]), ("a", [1, 2, 1]), ("b", [4, 5])])
    assert drafts == {"a": [2, 1]}


# ------------------------------------------------------------------ acceptance


def test_drafts_are_accepted_up_to_the_first_disagreement() -> None:
    assert accepted([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all, and the one after
    assert accepted([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the target's token replaces a miss
    assert accepted([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accepted([3], []) == [3]


@given(st.lists(st.integers(0, 3), min_size=1, max_size=6), st.data())
def test_acceptance_keeps_the_targets_tokens_and_stops_at_a_miss(
    targets: list[int], data: st.DataObject
) -> None:
    drafts = data.draw(
        st.lists(st.integers(0, 3), min_size=len(targets) - 1, max_size=len(targets) - 1)
    )
    kept = accepted(targets, drafts)
    assert kept == targets[: len(kept)]  # the target decides every token
    assert kept[:-1] == drafts[: len(kept) - 1]  # every token before the last was a draft
    assert len(kept) == len(targets) or kept[-1] != drafts[len(kept) - 1]


# ------------------------------------------------------------------ the scheduler


def speculating_scheduler(**overrides: object) -> Scheduler:
    return make_scheduler(num_speculative_tokens=3, **overrides)


def verify(
    scheduler: Scheduler, target: dict[str, list[int]], proposals: dict[str, list[int]]
) -> tuple[SchedulerOutput, dict[str, list[int]]]:
    """One step as the executor runs it, the step before collected: each row with draft slots
    verifies the drafts `proposals` holds for its request (as many as it has slots for), and
    its tokens are the target's (`target`: its next tokens) up to the first draft that misses."""
    plan = schedule(scheduler)
    return plan, report(scheduler, plan, target, proposals)


def schedule(scheduler: Scheduler) -> SchedulerOutput:
    """The next plan; which of its rows sample (reach the end of their request) is noted on
    it for `report`, in `spec_token_ids` (rank 0's field: the scheduler leaves it empty)."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    for request_id in plan.num_scheduled_tokens:
        request = scheduler.requests[request_id]
        if request.num_computed_tokens >= request.num_tokens:
            plan.spec_token_ids[request_id] = []
    return plan


def report(
    scheduler: Scheduler,
    plan: SchedulerOutput,
    target: dict[str, list[int]],
    proposals: dict[str, list[int]],
) -> dict[str, list[int]]:
    """Hand the scheduler `plan`'s step (from `schedule`) as `verify` runs it; what each
    request got."""
    sampled, num_drafts = {}, {}
    for request_id in plan.spec_token_ids:
        if request_id in scheduler.requests:
            drafts = proposals.get(request_id, [])[: plan.draft_slots.get(request_id, 0)]
            sampled[request_id] = accepted(target[request_id][: len(drafts) + 1], drafts)
            if drafts:
                num_drafts[request_id] = len(drafts)
    result = ModelRunnerOutput(step=plan.step, sampled=sampled, num_drafts=num_drafts)
    outputs = scheduler.update(plan, result)
    scheduler.check_invariants()
    return {out.request_id: out.new_token_ids for out in outputs}


def test_a_row_verifies_its_drafts_and_moves_past_what_was_accepted() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=20, ignore_eos=True)
    plan, got = verify(scheduler, {"a": [50]}, {})
    assert plan.num_scheduled_tokens == {"a": 3} and not plan.draft_slots and got == {"a": [50]}
    request = scheduler.requests["a"]
    # Room for 3 drafts; two match, the third does not: 51 52 then the target's 60.
    plan, got = verify(scheduler, {"a": [51, 52, 60, 99]}, {"a": [51, 52, 53]})
    assert plan.num_scheduled_tokens == {"a": 4} and plan.draft_slots == {"a": 3}
    assert got == {"a": [51, 52, 60]}
    # The KV of the rejected draft is past the computed tokens: the next row starts at 60.
    assert request.num_computed_tokens == request.num_tokens - 1 == 3 + 4 - 1
    # Fewer drafts found than the row has slots for: two, both accepted, and the token after.
    plan, got = verify(scheduler, {"a": [61, 62, 63]}, {"a": [61, 62]})
    assert plan.draft_slots == {"a": 3} and got == {"a": [61, 62, 63]}
    assert request.num_computed_tokens == request.num_tokens - 1
    assert scheduler.spec_decode.num_draft_tokens == 5
    assert scheduler.spec_decode.num_accepted_tokens == 4
    assert scheduler.spec_decode.accepted_per_position == [2, 2, 0]
    assert scheduler.spec_decode.mean_acceptance_length == 3.0


def test_a_stop_token_among_the_accepted_ends_the_request_there() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=20)
    verify(scheduler, {"a": [50]}, {})
    _, got = verify(scheduler, {"a": [51, EOS, 53, 54]}, {"a": [51, EOS, 53]})
    assert got == {"a": [51, EOS]}
    assert "a" not in scheduler.requests
    assert scheduler.kv.pool.num_available == scheduler.config.num_blocks  # nothing leaked


def test_draft_slots_stop_where_max_tokens_and_max_model_len_leave_no_room() -> None:
    scheduler = speculating_scheduler(max_model_len=16)
    add(scheduler, "a", [10, 11, 12], max_tokens=3, ignore_eos=True)
    add(scheduler, "b", [10] * 12, max_tokens=4, ignore_eos=True)
    verify(scheduler, {"a": [50], "b": [70]}, {})
    # a: 1 output of 3: one draft may still be kept beside the token after it; b: 13 tokens
    # of 16 (and 1 output of 4): two.
    plan, got = verify(
        scheduler, {"a": [51, 52], "b": [71, 72, 73]}, {"a": [51, 52, 53], "b": [71, 72, 73]}
    )
    assert plan.draft_slots == {"a": 1, "b": 2}
    assert got == {"a": [51, 52], "b": [71, 72, 73]}
    assert not scheduler.requests


def test_a_speculating_row_runs_pipelined_with_room_for_drafts() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=20, ignore_eos=True)
    first = schedule(scheduler)
    # Pipelined: the next plan is made before the first step's token arrives, with room for
    # the drafts the executor will propose once that token is in.
    second = schedule(scheduler)
    assert second.num_scheduled_tokens == {"a": 4} and second.draft_slots == {"a": 3}
    request = scheduler.requests["a"]
    assert (request.num_pending_tokens, request.num_computed_tokens) == (1 + 4, 3 + 4)
    report(scheduler, first, {"a": [5]}, {})
    # Bounds until the second step is reported, which may bring up to 4 tokens.
    third = schedule(scheduler)
    assert third.cached_requests[0].num_computed_tokens == 3 + 4
    report(scheduler, second, {"a": [6, 7]}, {"a": [6]})  # one draft, accepted
    assert (request.num_tokens, request.num_computed_tokens) == (6, 5 + 4)
    report(scheduler, third, {"a": [8]}, {})
    assert (request.num_pending_tokens, request.num_computed_tokens) == (0, 6)
    assert request.num_computed_tokens == request.num_tokens - 1


def pipelined_steps(
    scheduler: Scheduler, num_steps: int, drafts_from: int
) -> list[tuple[int, int]]:
    """Steps of a pipelined loop (each plan made before the last step's tokens arrive) for a
    request "a" whose proposer finds nothing before step `drafts_from` and a draft that is
    accepted from then on: (step, its draft slots) for each step that runs it."""
    planned, last = [], None
    for step in range(num_steps):
        plan = schedule(scheduler)
        if "a" in plan.num_scheduled_tokens:
            planned.append((step, plan.draft_slots.get("a", 0)))
        if last is not None and "a" in last.num_scheduled_tokens:
            drafts = [7] if step >= drafts_from else []
            report(scheduler, last, {"a": [7, 7]}, {"a": drafts})
        last = plan
        scheduler.check_invariants()
    return planned


def test_a_request_whose_proposals_find_nothing_gets_no_slots_for_longer_and_longer() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=100, ignore_eos=True)
    planned = pipelined_steps(scheduler, 24, drafts_from=99)
    assert [step for step, _ in planned] == list(range(24))  # it runs every step
    # A miss is known a step late, so two rows with slots find nothing each time; then no
    # slots for 2, 4, 8 steps.
    with_slots = [step for step, slots in planned if slots]
    assert with_slots == [1, 2, 5, 6, 11, 12, 21, 22]
    assert scheduler.requests["a"].spec_misses == 4


def test_drafts_found_give_the_request_slots_again() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=100, ignore_eos=True)
    planned = pipelined_steps(scheduler, 20, drafts_from=12)
    assert [slots for _, slots in planned][-6:] == [3] * 6
    assert scheduler.requests["a"].spec_misses == 0
    assert scheduler.spec_decode.num_drafts >= 6


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_no_block_leaks_whatever_is_accepted(data: st.DataObject) -> None:
    """Pipelined steps or not, whatever the proposer finds and the target accepts."""
    scheduler = speculating_scheduler(num_blocks=24, max_num_batched_tokens=16)
    for i in range(data.draw(st.integers(1, 4))):
        prompt = data.draw(st.lists(st.integers(3, 40), min_size=1, max_size=20))
        add(scheduler, str(i), prompt, max_tokens=data.draw(st.integers(1, 12)))
    tokens = st.integers(0, 8)  # EOS (2) among them
    in_flight: list[SchedulerOutput] = []
    for _ in range(200):
        if not scheduler.has_unfinished() and not in_flight:
            break
        if scheduler.has_unfinished():
            in_flight.append(schedule(scheduler))
        if len(in_flight) == 2 or not data.draw(st.booleans()) or not scheduler.has_unfinished():
            step = in_flight.pop(0)
            live = list(step.num_scheduled_tokens)
            target = {rid: data.draw(st.lists(tokens, min_size=4, max_size=4)) for rid in live}
            drafts = {rid: data.draw(st.lists(tokens, max_size=3)) for rid in live}
            report(scheduler, step, target, drafts)
    assert not scheduler.has_unfinished()
    assert scheduler.kv.pool.num_available == scheduler.config.num_blocks


# ------------------------------------------------------------------ what it reports


def test_the_stats_line_and_metrics_show_acceptance() -> None:
    before = stats(num_blocks=100)
    after = msgspec.structs.replace(
        before,
        num_generation_tokens=300,
        spec_num_drafts=100,
        spec_num_draft_tokens=400,
        spec_num_accepted_tokens=150,
        spec_accepted_per_position=[80, 40, 20, 10],
    )
    log = StatsLog(interval=1.0)
    log.line(0.0, before)
    line = log.line(1.0, after)
    assert line is not None
    assert line.endswith(", spec decode: mean acceptance length 2.50, draft acceptance rate 37.5%")
    text = Metrics("m").render([after], num_tokenizer_workers=1, num_in_flight=0)
    assert 'kvflow:spec_decode_num_accepted_tokens_total{model_name="m",replica="0"} 150' in text
    assert (
        'kvflow:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",replica="0",'
        'position="2"} 20'
    ) in text


def test_the_scheduler_reports_its_totals() -> None:
    scheduler = speculating_scheduler()
    add(scheduler, "a", [10, 11, 12], max_tokens=20, ignore_eos=True)
    verify(scheduler, {"a": [50]}, {})
    verify(scheduler, {"a": [51, 60, 70]}, {"a": [51, 52]})
    snapshot = scheduler.stats()
    assert (snapshot.spec_num_drafts, snapshot.spec_num_draft_tokens) == (1, 2)
    assert snapshot.spec_num_accepted_tokens == 1
    assert snapshot.spec_accepted_per_position == [1, 0]


def test_under_load_each_row_has_room_for_fewer_drafts() -> None:
    assert [drafts_per_row(n) for n in (1, 51, 52, 86, 128, 129)] == [255, 4, 3, 1, 1, 0]
    scheduler = make_scheduler(
        num_speculative_tokens=5, max_num_seqs=64, num_blocks=512, max_num_batched_tokens=512
    )
    for i in range(64):
        add(scheduler, str(i), [10, 11, 12], max_tokens=20, ignore_eos=True)
    verify(scheduler, {str(i): [50] for i in range(64)}, {})
    plan, _ = verify(scheduler, {str(i): [1, 2, 3, 4, 5, 6] for i in range(64)}, {})
    assert len(plan.draft_slots) == 64
    assert set(plan.draft_slots.values()) == {drafts_per_row(64)} == {3}


# ------------------------------------------------------------------ suffix decoding


def suffix(**keys: object) -> SuffixProposer:
    config = parse_speculative_config(json.dumps({"method": "suffix", **keys}))
    assert config is not None
    return SuffixProposer(config)


def test_suffix_config_takes_vllms_keys_and_defaults() -> None:
    config = parse_speculative_config('{"method": "suffix"}')
    assert config is not None
    assert (config.num_speculative_tokens, config.suffix_max_tree_depth) == (24, 24)
    assert (config.suffix_max_cached_requests, config.suffix_min_token_prob) == (10000, 0.1)
    with pytest.raises(SpeculativeConfigError, match="do not apply"):
        parse_speculative_config('{"method": "suffix", "prompt_lookup_max": 3}')
    with pytest.raises(SpeculativeConfigError, match="<= 1"):
        parse_speculative_config('{"method": "suffix", "suffix_decoding_min_token_prob": 2}')


def test_suffix_drafts_follow_the_longest_match_as_far_as_its_length() -> None:
    # "1 2 3" occurred before, followed by 4 5 9: trusted for 3 tokens (spec factor 1).
    assert suffix().propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5, 9]
    assert suffix(suffix_decoding_max_spec_factor=0.5).propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4]
    assert suffix(num_speculative_tokens=2).propose([1, 2, 3, 4, 5, 9, 1, 2, 3]) == [4, 5]


def test_suffix_drafts_take_the_most_frequent_continuation_while_likely() -> None:
    # "5 7" was followed by 1 twice and by 2 once.
    tokens = [5, 7, 1, 5, 7, 1, 5, 7, 2, 5, 7]
    assert suffix().propose(tokens) == [1, 5]  # 2/3, then 2/3 of the way
    assert suffix(suffix_decoding_min_token_prob=0.7).propose(tokens) == []


def test_suffix_drafts_come_from_recent_outputs_too() -> None:
    proposer = suffix()
    assert proposer.propose([99, 10, 11]) == []
    proposer.finished("x", [10, 11, 12, 13, 14])
    assert proposer.propose([99, 10, 11]) == [12, 13]
    off = suffix(suffix_decoding_max_cached_requests=0)
    off.finished("x", [10, 11, 12, 13, 14])
    assert off.propose([99, 10, 11]) == []


def test_suffix_cache_keeps_the_most_recent_outputs() -> None:
    proposer = suffix(suffix_decoding_max_cached_requests=2)
    for output in ([1, 2, 3, 4], [5, 6, 7, 8], [9, 6, 7, 9]):
        proposer.finished("x", output)
    assert proposer.propose([0, 1, 2]) == []  # the first output left the cache
    assert proposer.propose([0, 6, 7]) == [8]  # "6 7" then 8 or 9: 8 first of a tie, 1/2


def test_draft_slots_without_blocks_are_dropped_rather_than_preempt() -> None:
    scheduler = speculating_scheduler(num_blocks=2, block_size=4)
    add(scheduler, "a", [10, 11, 12], max_tokens=5, ignore_eos=True)
    add(scheduler, "b", [20, 21, 22], max_tokens=5, ignore_eos=True)
    verify(scheduler, {"a": [50], "b": [60]}, {})
    # Each holds one of the two blocks, where its next token fits; draft slots would need more.
    plan, got = verify(scheduler, {"a": [51], "b": [61]}, {"a": [51, 52, 53]})
    assert plan.num_scheduled_tokens == {"a": 1, "b": 1} and not plan.draft_slots
    assert scheduler.num_preemptions == 0 and got == {"a": [51], "b": [61]}
