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
    sampled = dict.fromkeys(plan.num_scheduled_tokens, 11)
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
    sampled = dict.fromkeys(first.num_scheduled_tokens, 11)
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
    assert pending is not None and pending.request_id == "r1" and "c" in registry.adapters
    assert registry.version > version
    assert registry.unload("c").lora_id == 3
    with pytest.raises(NotFoundError, match="no LoRA adapter"):
        registry.unload("c")
    failed = registry.begin_load("r3", b"worker", "c", "/bad")
    assert failed == 4  # never 3 again: a prefix cached under 3 is not found under 4
    assert registry.finish_load(failed, loaded=False) is not None and "c" not in registry.adapters
    registry.finish_load(registry.begin_load("r4", b"worker", "d", "/d"), loaded=True)
    assert registry.drop_runtime_loads() == ["d"]  # a new executor has those of the flag
    assert list(registry.adapters) == ["a", "b"]
