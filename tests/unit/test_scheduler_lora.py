"""The scheduler and LoRA adapters: never more adapters among the running requests (so in a
step) than the executor has slots, requests of a waiting adapter do not hold up others, an
addendum counts the adapters of the plan it joins, unknown adapters are refused, prefix-cache
keys depend on the adapter; and the scheduler process's registry of adapter names."""

from __future__ import annotations

import pytest

from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from shared.lora_modules import parse_lora_modules
from shared.protocol import (
    EngineRequest,
    ModelRunnerOutput,
    NotFoundError,
    ParameterError,
    SamplingParams,
)
from tests.unit.scheduler_setup import make_scheduler


def add(scheduler: Scheduler, request_id: str, lora_id: int, max_tokens: int = 2) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = EngineRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7, 8, 9], sampling_params=params,
        lora_id=lora_id,
    )  # fmt: skip
    scheduler.add_request(request)


def lora_scheduler(max_loras: int, **overrides: object) -> Scheduler:
    scheduler = make_scheduler(max_loras=max_loras, **overrides)
    for lora_id in (1, 2, 3):
        scheduler.add_lora(lora_id)
    return scheduler


def step(scheduler: Scheduler) -> set[str]:
    """One unpipelined step; the requests it ran."""
    plan = scheduler.schedule()
    scheduler.check_invariants()
    sampled = {rid: [11] for rid in plan.num_scheduled_tokens}
    scheduler.update(plan, ModelRunnerOutput(step=plan.step, sampled=sampled))
    scheduler.check_invariants()
    return set(plan.num_scheduled_tokens)


def test_a_third_adapter_waits_for_a_slot_without_holding_up_the_others() -> None:
    scheduler = lora_scheduler(max_loras=2)
    add(scheduler, "a1", 1, max_tokens=1)
    add(scheduler, "b1", 2, max_tokens=4)
    add(scheduler, "c1", 3)  # no slot left: waits
    add(scheduler, "base", 0, max_tokens=1)  # the base model needs none: runs past c1
    add(scheduler, "a2", 1, max_tokens=1)  # adapter 1 runs already: runs past c1
    assert step(scheduler) == {"a1", "b1", "base", "a2"}
    assert [r.request_id for r in scheduler.waiting] == ["c1"]
    assert step(scheduler) == {"b1", "c1"}  # a1 and a2 are done: adapter 1's slot is free


def test_an_addendum_counts_the_adapters_of_requests_that_ended() -> None:
    """A request that ended while the next plan was held keeps its row, and its adapter, in
    that plan: an addendum must not bring a third adapter into it with two slots."""
    scheduler = lora_scheduler(max_loras=2, max_num_seqs=4)
    add(scheduler, "a", 1, max_tokens=2)
    add(scheduler, "b", 2, max_tokens=4)
    first = scheduler.schedule()
    held = scheduler.schedule()  # a's and b's decodes: adapters 1 and 2
    assert set(held.num_scheduled_tokens) == {"a", "b"}
    scheduler.abort(["a"])  # a ends; its row stays in held
    add(scheduler, "c", 3)
    assert scheduler.schedule_addendum(held) is None  # held runs adapters 1 and 2 still
    sampled = {rid: [11] for rid in first.num_scheduled_tokens}
    scheduler.update(first, ModelRunnerOutput(step=first.step, sampled=sampled))
    nxt = scheduler.schedule()  # a whole plan: adapter 1's slot is free now
    assert set(nxt.num_scheduled_tokens) == {"b", "c"}


def test_unknown_adapters_and_lora_without_slots_are_refused() -> None:
    scheduler = lora_scheduler(max_loras=1)
    with pytest.raises(ParameterError, match="no LoRA adapter has id 7") as error:
        add(scheduler, "x", 7)
    assert error.value.param == "model"
    without = make_scheduler()
    with pytest.raises(ParameterError, match="not enabled"):
        without.add_lora(1)
    with pytest.raises(ParameterError, match="no LoRA adapter has id 1"):
        add(without, "y", 1)


def test_block_keys_depend_on_the_adapter() -> None:
    scheduler = lora_scheduler(max_loras=3, block_size=4)
    for index, lora_id in enumerate((0, 1, 2, 1)):
        add(scheduler, f"r{index}", lora_id)
    keys = [scheduler.requests[f"r{index}"].block_hashes for index in range(4)]
    assert keys[1] == keys[3]  # the same prompt under the same adapter: the same key
    assert len({k[0] for k in keys[:3]}) == 3  # under the base model and two adapters: three


def test_the_registry_names_adapters_and_never_reuses_an_id() -> None:
    modules = parse_lora_modules(("a=/a", '{"name": "b", "path": "/b", "base_model_name": "x"}'))
    registry = LoraRegistry(modules)
    registry.base_model = "served"
    assert [(a.name, a.lora_id, a.parent) for a in registry.listing()] == [
        ("a", 1, "served"),
        ("b", 2, "x"),
    ]
    version = registry.version
    with pytest.raises(ParameterError, match="loaded already"):
        registry.begin_load("r1", b"worker", "a", "/a2")
    with pytest.raises(ParameterError, match="folder"):
        registry.begin_load("r1", b"worker", "c", None)
    lora_id = registry.begin_load("r1", b"worker", "c", "/c")
    assert lora_id == 3 and "c" not in registry.adapters  # pending until the executor says
    with pytest.raises(ParameterError, match="loaded already"):
        registry.begin_load("r2", b"worker", "c", "/c")  # a load of that name is pending
    pending = registry.finish_load(lora_id, loaded=True)
    assert (
        pending is not None and pending.request_id == "r1" and registry.held[3].adapter.name == "c"
    )
    assert "c" not in registry.adapters and registry.version == version  # held, not named
    with pytest.raises(ParameterError, match="loaded already"):
        registry.begin_load("r2", b"worker", "c", "/c")  # held: its commit is on its way
    assert registry.commit(lora_id) is not None and "c" in registry.adapters
    assert registry.version > version
    assert registry.unload("c")[0].lora_id == 3
    with pytest.raises(NotFoundError, match="no LoRA adapter"):
        registry.unload("c")
    failed = registry.begin_load("r3", b"worker", "c", "/bad")
    assert failed == 4  # never 3 again: a prefix cached under 3 is not found under 4
    assert registry.finish_load(failed, loaded=False) is not None and "c" not in registry.adapters
    registry.commit(registry.begin_load("r4", b"worker", "d", "/d"))  # pending: not named
    assert "d" not in registry.adapters
    held = registry.begin_load("r5", b"worker", "e", "/e")
    registry.finish_load(held, loaded=True)
    named = registry.begin_load("r6", b"worker", "f", "/f")
    registry.finish_load(named, loaded=True)
    registry.commit(named)
    # A new executor has those of the flag: named, pending and held loads are gone.
    assert registry.drop_runtime_loads() == ["f", "d", "e"]
    assert list(registry.adapters) == ["a", "b"] and not registry.pending and not registry.held


def test_a_replica_takes_the_id_it_is_given_once_and_forgets_a_load_in_any_state() -> None:
    """Replicas other than the first take the id the first named; no id is taken twice (ids
    of two loads under way may come in either order). A discard forgets a load pending, held
    or named, by its id (or its request); an unload, by its name."""
    registry = LoraRegistry(parse_lora_modules(("a=/a",)))
    assert registry.begin_load("r1", b"w", "x", "/x", lora_id=5) == 5
    assert registry.begin_load("r2", b"w", "y", "/y", lora_id=4) == 4  # overtaken by 5
    for taken in (1, 4, 5):
        with pytest.raises(ParameterError, match=f"took LoRA adapter id {taken} before"):
            registry.begin_load("r3", b"w", "z", "/z", lora_id=taken)
    assert registry.begin_load("r3", b"w", "z", "/z") == 6  # named here: above every one taken
    registry.finish_load(5, loaded=True)
    registry.commit(5)
    registry.finish_load(6, loaded=True)
    discarded = [registry.discard(i, "") for i in (4, 5, 6)]
    assert [getattr(adapter, "name", None) for adapter in discarded] == ["y", "x", "z"]
    assert registry.discard(5, "") is None and registry.finish_load(4, loaded=True) is None
    assert list(registry.adapters) == ["a"] and not registry.pending and not registry.held
    # An unload forgets a pending load too (its answer is due now); given a bound, only an
    # adapter taken under an id below it (a later one is a newer load's).
    registry.begin_load("r4", b"w", "x", "/x", lora_id=7)
    adapter, pending = registry.unload("x")
    assert adapter.lora_id == 7 and pending is not None and pending.request_id == "r4"
    assert registry.finish_load(7, loaded=True) is None  # the executor's late answer
    registry.begin_load("r5", b"w", "x", "/x", lora_id=9)
    registry.finish_load(9, loaded=True)
    with pytest.raises(NotFoundError):
        registry.unload("x", below=9)
    adapter, pending = registry.unload("x", below=10)
    assert (adapter.lora_id, pending, registry.next_id) == (9, None, 10)
    # A discard without the id (it never reached the worker) finds the load by its request.
    registry.begin_load("r9", b"w", "w", "/w")
    assert registry.discard(None, "r8") is None and registry.pending
    assert getattr(registry.discard(None, "r9"), "name", None) == "w" and not registry.pending
    assert registry.commit(9) is None and not registry.held
