"""The frontend's tokenizer pool: workers join by beating, requests stay with their worker,
and a worker that leaves or restarts takes its requests with it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from services.frontend.engine.tokenizer_pool import TokenizerPool


def pool_of(*names: str, at: float = 0.0) -> TokenizerPool:
    pool = TokenizerPool()
    for name in names:
        assert pool.beat(name, "s1", at) == []
    return pool


def test_an_empty_pool_takes_no_request() -> None:
    pool = TokenizerPool()
    assert pool.assign("r") is None and pool.owner("r") is None and pool.last_heard is None


def test_requests_go_to_the_least_loaded_worker_and_stay_there() -> None:
    pool = pool_of("tokenizer-a", "tokenizer-b")
    assert [pool.assign(r) for r in "123"] == ["tokenizer-a", "tokenizer-b", "tokenizer-a"]
    pool.release("1")
    pool.release("3")
    assert pool.assign("4") == "tokenizer-a"  # a holds none now, b one
    assert pool.assign("5") == "tokenizer-a"  # one each: ties go by name
    assert [pool.owner(r) for r in "245"] == ["tokenizer-b", "tokenizer-a", "tokenizer-a"]


def test_a_worker_that_joins_later_takes_the_next_requests() -> None:
    pool = pool_of("tokenizer-a")
    pool.assign("1")
    pool.beat("tokenizer-b", "s1", 1.0)
    assert pool.assign("2") == "tokenizer-b"


def test_a_worker_that_leaves_takes_its_requests_with_it() -> None:
    pool = pool_of("tokenizer-a", "tokenizer-b")
    pool.assign("1"), pool.assign("2"), pool.assign("3")
    assert pool.leave("tokenizer-b") == ["2"]
    assert pool.names == ["tokenizer-a"] and pool.owner("2") is None
    assert pool.leave("tokenizer-b") == []
    assert pool.assign("4") == "tokenizer-a"


def test_a_restarted_worker_loses_what_its_previous_process_held() -> None:
    pool = pool_of("tokenizer-a")
    pool.assign("1"), pool.assign("2")
    assert pool.beat("tokenizer-a", "s1", 1.0) == []  # the same process: nothing lost
    assert pool.beat("tokenizer-a", "s2", 2.0) == ["1", "2"]
    assert pool.names == ["tokenizer-a"] and pool.owner("1") is None
    assert pool.assign("3") == "tokenizer-a"


def test_a_draining_worker_keeps_its_requests_but_takes_no_new_ones() -> None:
    pool = pool_of("tokenizer-a", "tokenizer-b")
    pool.assign("1"), pool.assign("2")
    assert pool.beat("tokenizer-a", "s1", 1.0, draining=True) == []
    assert pool.draining("tokenizer-a") and not pool.draining("tokenizer-b")
    assert pool.accepting == ["tokenizer-b"] and pool.names == ["tokenizer-a", "tokenizer-b"]
    assert [pool.assign(r) for r in "34"] == ["tokenizer-b", "tokenizer-b"]
    assert pool.owner("1") == "tokenizer-a"  # finishes where it is
    pool.beat("tokenizer-b", "s1", 1.0, draining=True)
    assert pool.assign("5") is None


def test_releasing_an_unknown_or_lost_request_is_harmless() -> None:
    pool = pool_of("tokenizer-a")
    pool.assign("1")
    pool.leave("tokenizer-a")
    pool.release("1")
    pool.release("never")
    assert pool.leave("tokenizer-a") == []


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["assign", "release", "beat", "restart", "leave"]), st.integers(0, 3)
        ),
        max_size=60,
    )
)
def test_every_request_has_exactly_one_live_owner(ops: list[tuple[str, int]]) -> None:
    """Whatever happens, an owned request belongs to a worker in the pool and is counted by
    that worker alone, and a worker never holds a request it does not own."""
    pool, sessions, counter = TokenizerPool(), {}, 0
    for op, k in ops:
        name = f"tokenizer-{k}"
        if op == "assign":
            counter += 1
            pool.assign(str(counter))
        elif op == "release":
            pool.release(str(k))
        elif op in ("beat", "restart"):
            sessions[name] = sessions.get(name, 0) + (op == "restart")
            pool.beat(name, str(sessions[name]), 0.0)
        else:
            pool.leave(name)
        pool.check_invariants()
