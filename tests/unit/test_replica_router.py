"""The data-parallel router: the engine holding a prompt's prefix takes it unless it is busier
than the slack allows, cold requests go to the least busy in turn (its load: this worker's
requests counted exactly, the other workers' as the engine last reported them), and a new
engine session forgets what the old one held."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.tokenizer.replica_router import BALANCE_SLACK, ReplicaRouter
from shared.block_hashes import prefix_block_keys
from shared.protocol import KvEventBatch

BLOCK = 16
ME = "tokenizer-0"  # the worker the router routes for
PROMPT = list(range(100, 100 + 4 * BLOCK))


def batch(replica: int, seq: int = 0, session: int = 1, **fields: object) -> KvEventBatch:
    values: dict = dict(stored=[], removed=[], num_running=0, num_waiting=0, kv_usage=0.0)
    values.update(fields)
    return KvEventBatch(replica=replica, session=session, seq=seq, block_size=BLOCK, **values)


def test_cold_requests_go_round_the_engines() -> None:
    router = ReplicaRouter(3)
    assert [router.pick(PROMPT) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_the_engine_holding_the_longest_prefix_takes_the_prompt() -> None:
    router = ReplicaRouter(3)
    keys = prefix_block_keys(PROMPT, BLOCK)
    router.observe(batch(0, stored=keys[:1]))
    router.observe(batch(2, stored=keys[:3]))
    router.observe(batch(1, stored=keys[1:]))  # no first block: holds nothing of this prompt
    assert router.cached_blocks(PROMPT) == [1, 0, 3]
    assert [router.pick(PROMPT) for _ in range(3)] == [2, 2, 2]
    assert router.cached_blocks(PROMPT, lora_id=5) == [0, 0, 0]  # another adapter's keys


def test_a_busy_holder_loses_the_prompt_to_the_least_busy() -> None:
    router = ReplicaRouter(2)
    router.observe(batch(1, stored=prefix_block_keys(PROMPT, BLOCK), num_running=BALANCE_SLACK))
    assert router.pick(PROMPT) == 1  # busier by the slack: still the holder
    assert router.pick(PROMPT) == 0  # one more sent to it: past the slack
    router.observe(batch(1, seq=1, num_running=1))  # it caught up
    assert router.pick(PROMPT) == 1


def test_evicted_keys_and_a_new_session_drop_what_was_held() -> None:
    router = ReplicaRouter(2)
    keys = prefix_block_keys(PROMPT, BLOCK)
    router.observe(batch(0, stored=keys))
    router.observe(batch(0, seq=1, removed=keys[2:]))
    assert router.cached_blocks(PROMPT) == [2, 0]
    router.observe(batch(0, seq=0, session=2))  # the engine restarted
    assert router.cached_blocks(PROMPT) == [0, 0]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40))
def test_without_prefixes_no_engine_runs_ahead_of_another_by_more_than_one(
    prompts: list[int],
) -> None:
    router = ReplicaRouter(3)
    sent = [0, 0, 0]
    for n in prompts:
        sent[router.pick(list(range(n * BLOCK, n * BLOCK + 40)))] += 1
    assert max(sent) - min(sent) <= 1


def test_round_robin_ignores_what_engines_hold() -> None:
    router = ReplicaRouter(2, by_prefix=False)
    router.observe(batch(1, stored=prefix_block_keys(PROMPT, BLOCK)))
    assert [router.pick(PROMPT) for _ in range(4)] == [0, 1, 0, 1]


def test_an_engine_with_a_full_queue_is_passed_over_while_another_is_not() -> None:
    router = ReplicaRouter(2)
    router.observe(batch(0, stored=prefix_block_keys(PROMPT, BLOCK), queue_full=True))
    assert [router.pick(PROMPT) for _ in range(2)] == [1, 1]  # not the holder: it would refuse
    router.observe(batch(1, queue_full=True))
    assert router.pick(PROMPT) == 0  # every one full: the holder, which says so itself


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pick", "report", "end"]), st.integers(0, 2))))
def test_reports_that_lag_a_burst_do_not_lean_it_on_one_engine(
    steps: list[tuple[str, int]],
) -> None:
    """One worker's cold requests: whenever reports come, and however far behind (an engine
    reports only some of the requests on their way to it), each goes to an engine with the
    fewest of them."""
    router = ReplicaRouter(3, worker=ME)
    live = [0, 0, 0]  # this worker's requests on each engine
    seq = [0, 0, 0]
    for step, replica in steps:
        if step == "pick":
            chosen = router.pick(list(range(40)))
            assert live[chosen] == min(live)
            live[chosen] += 1
        elif step == "report":  # it has seen half of them
            seen = live[replica] // 2
            report = batch(replica, seq=seq[replica], num_waiting=seen, num_by_worker={ME: seen})
            router.observe(report)
            seq[replica] += 1
        elif live[replica]:
            router.release(replica)
            live[replica] -= 1


def test_other_workers_requests_count_from_reports_and_own_ones_once() -> None:
    router = ReplicaRouter(2, worker=ME)
    router.observe(batch(0, num_waiting=10, num_by_worker={"other": 10}))
    assert [router.pick(PROMPT) for _ in range(3)] == [1, 1, 1]
    router.observe(batch(1, num_waiting=3, num_by_worker={ME: 3}))  # counted once, not twice
    assert router.loads()[1] == 3
    assert router.pick(PROMPT) == 1  # 3 against 10
    router.release(1)
    assert router.loads()[1] == 3  # 4 sent, 1 ended


def test_two_workers_split_a_burst_evenly_when_one_engine_reports_late() -> None:
    """Two workers take turns with cold requests; engine 0 reports after every request,
    engine 1 after every 200th. Each worker counts the other's requests on engine 1 as
    reported plus as many as it sent there itself since: the burst splits evenly (taking the
    report alone, the late engine looked emptier and took 525 of 1,000)."""
    routers = {name: ReplicaRouter(2, worker=name) for name in ("a", "b")}
    arrived = [{"a": 0, "b": 0}, {"a": 0, "b": 0}]
    seq = [0, 0]

    def report(replica: int) -> None:
        counts = {name: n for name, n in arrived[replica].items() if n}
        for router in routers.values():
            router.observe(
                batch(replica, seq=seq[replica], num_running=sum(counts.values()),
                      num_by_worker=counts)
            )  # fmt: skip
        seq[replica] += 1

    for i in range(1000):
        name = "ab"[i % 2]
        arrived[routers[name].pick(PROMPT)][name] += 1
        report(0)
        if i % 200 == 0:
            report(1)
    assert [sum(counts.values()) for counts in arrived] == [500, 500]


def test_a_pick_among_some_engines_keeps_to_them() -> None:
    """Prefill/decode disaggregation: prompts go to the prefill engines, then to the decode
    engines, each group by its own prefixes and load."""
    router = ReplicaRouter(4)
    router.observe(batch(0, stored=prefix_block_keys(PROMPT, BLOCK)))  # not among the decoders
    router.observe(batch(3, stored=prefix_block_keys(PROMPT, BLOCK)[:2]))
    assert [router.pick(PROMPT, among=range(2, 4)) for _ in range(2)] == [3, 3]
    assert [router.pick([7] * 40, among=range(2)) for _ in range(4)] == [0, 1, 0, 1]
    assert router.pick(PROMPT, among=[1]) == 1
    round_robin = ReplicaRouter(3, by_prefix=False)
    assert [round_robin.pick(PROMPT, among=[0, 2]) for _ in range(3)] == [0, 2, 0]
