"""Runtime LoRA loads and unloads across engine replicas: tokenizer workers' fan-outs
(services/tokenizer/lora_fanout.py) driving each replica's scheduler side (LoraControl over a
real Scheduler), joined by queues that the test delivers from, in order or from links picked
at random (each link keeps its order, as a ZeroMQ socket does). The executors' reads are
answered by the test. And what a frontend names from the replicas' listings."""

from __future__ import annotations

import functools
import itertools
import logging
import random

import pytest

from services.frontend.engine.lora_listings import LoraListings
from services.scheduler.lora_control import LoraControl
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.scheduler import Scheduler
from services.tokenizer.lora_fanout import LoraFanout
from shared.constants import LORA_LOAD_TIMEOUT_S
from shared.lora_modules import parse_lora_modules
from shared.protocol import (
    AddLoraAdapter,
    EngineRequest,
    ErrorKind,
    LoraAdapterAdded,
    LoraAdapterInfo,
    LoraAdapterListing,
    LoraAdapterRequest,
    LoraAdapterResult,
    NotFoundError,
    SamplingParams,
)
from tests.unit.scheduler_setup import make_scheduler

Link = tuple[str, int, str]  # ("scheduler" | "executor" | "worker", replica, worker)
Message = LoraAdapterRequest | AddLoraAdapter | LoraAdapterResult


class Replicas:
    """Every replica's scheduler side and every tokenizer worker's fan-out, and the messages on
    their way between them."""

    def __init__(self, num_replicas: int, workers: tuple[str, ...] = ("w",)) -> None:
        modules = parse_lora_modules(("static=/static",))
        self.schedulers = [make_scheduler(max_loras=4) for _ in range(num_replicas)]
        self.controls = [
            LoraControl(LoraRegistry(modules), True, r, functools.partial(self._to_worker, r))
            for r in range(num_replicas)
        ]
        for control, scheduler in zip(self.controls, self.schedulers, strict=True):
            control.adopt(scheduler, "base")
        self.answers: dict[str, list[LoraAdapterResult]] = {w: [] for w in workers}
        self.fanouts = {
            w: LoraFanout(num_replicas, functools.partial(self._to_scheduler, w), answers.append)
            for w, answers in self.answers.items()
        }
        self.wire: list[tuple[Link, Message]] = []  # oldest first
        self.asked: list[tuple[int, str]] = []  # (replica, action) as schedulers took them
        self.unreadable: set[tuple[int, str]] = set()  # (replica, name): its executor refuses
        self.request_ids: list[str] = []  # of the changes asked

    def ask(self, worker: str, action: str, name: str, path: str | None = None) -> None:
        request_id = f"{worker}-{len(self.request_ids)}"
        self.request_ids.append(request_id)
        request = LoraAdapterRequest(
            request_id=request_id, action=action, lora_name=name, lora_path=path
        )
        self.fanouts[worker].start(request, now=0.0)

    def run(self, skip: int | None = None) -> None:
        """Deliver everything, the oldest message first; never to the scheduler of replica
        `skip`."""
        while True:
            links = [link for link, _ in self.wire if link[:2] != ("scheduler", skip)]
            if not links:
                return
            self.deliver(links[0])

    def pick(self, rng: random.Random, slow: int | None = None) -> Link:
        """A link with messages on it, at random; the scheduler of replica `slow` only when
        nothing else has any."""
        links = sorted({link for link, _ in self.wire})
        quick = [link for link in links if link[:2] != ("scheduler", slow)]
        return rng.choice(quick or links)

    def deliver(self, link: Link) -> None:
        index = next(i for i, (on, _) in enumerate(self.wire) if on == link)
        _, message = self.wire.pop(index)
        _, replica, worker = link
        control = self.controls[replica]
        if isinstance(message, LoraAdapterRequest):
            self.asked.append((replica, message.action))
            to_executor = functools.partial(self._to_executor, replica)
            control.request(worker.encode(), message, self.schedulers[replica], to_executor)
        elif isinstance(message, AddLoraAdapter):
            unreadable = (replica, message.name) in self.unreadable
            error = f"{message.name} is unreadable" if unreadable else None
            control.added(LoraAdapterAdded(lora_id=message.lora_id, error=error))
        else:
            self.fanouts[worker].on_result(replica, message)

    def _to_scheduler(self, worker: str, replica: int, request: LoraAdapterRequest) -> None:
        self.wire.append((("scheduler", replica, worker), request))

    def _to_executor(self, replica: int, message: AddLoraAdapter) -> None:
        self.wire.append((("executor", replica, ""), message))

    def _to_worker(self, replica: int, owner: bytes, result: LoraAdapterResult) -> None:
        self.wire.append((("worker", replica, owner.decode()), result))

    def replace_executor(self, replica: int) -> None:
        """A new executor for the replica: the old one's reads are lost with it."""
        self.wire = [(link, m) for link, m in self.wire if link[:2] != ("executor", replica)]
        self.schedulers[replica] = make_scheduler(max_loras=4)
        self.controls[replica].adopt(self.schedulers[replica], "base")

    def named(self, replica: int) -> dict[str, int]:
        return {a.name: a.lora_id for a in self.controls[replica].registry.listing()}

    def held_or_named(self, replica: int) -> set[tuple[str, int]]:
        registry = self.controls[replica].registry
        return set(self.named(replica).items()) | {
            (p.adapter.name, p.adapter.lora_id) for p in registry.held.values()
        }

    def check_settled(self) -> None:
        """Every change answered once; the replicas name the same adapters under the same ids,
        admit requests for those alone, and hold no load half-done."""
        assert not self.wire and not any(f.changes for f in self.fanouts.values())
        answered = [a.request_id for answers in self.answers.values() for a in answers]
        assert sorted(answered) == sorted(self.request_ids)
        for replica, control in enumerate(self.controls):
            assert self.named(replica) == self.named(0), replica
            assert not control.registry.pending and not control.registry.held
            assert self.schedulers[replica].lora_ids == set(self.named(replica).values())


def run_request(scheduler: Scheduler, lora_id: int) -> None:
    params = SamplingParams(max_tokens=2)
    scheduler.add_request(
        EngineRequest(request_id=f"req-{lora_id}", prompt_token_ids=[5, 6, 7],
                      sampling_params=params, lora_id=lora_id)
    )  # fmt: skip


def test_a_load_is_named_on_every_replica_under_one_id_and_answered_after() -> None:
    replicas = Replicas(3)
    replicas.ask("w", "load", "x", "/x")
    while replicas.wire:
        replicas.deliver(replicas.wire[0][0])
        if any("x" in replicas.named(r) for r in range(3)):  # only once every replica holds it
            assert all(("x", 2) in replicas.held_or_named(r) for r in range(3))
        if replicas.answers["w"]:  # only once every replica names it
            assert all("x" in replicas.named(r) for r in range(3))
    # Replica 0 names the id, the others take it as that id; replica 0 commits last.
    assert replicas.asked == [
        (0, "load"), (1, "load"), (2, "load"), (1, "commit"), (2, "commit"), (0, "commit"),
    ]  # fmt: skip
    (answer,) = replicas.answers["w"]
    assert answer.error is None and answer.lora_id == 2  # 1 is --lora-modules' static
    assert [listing.replica for listing in answer.listings] == [0, 1, 2]
    for replica, listing in enumerate(answer.listings):
        assert [(a.name, a.lora_id) for a in listing.adapters] == [("static", 1), ("x", 2)]
        run_request(replicas.schedulers[replica], 2)  # every replica takes requests for it
    replicas.check_settled()


def test_one_replica_runs_the_same_rounds() -> None:
    replicas = Replicas(1)
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    replicas.ask("w", "unload", "x")
    replicas.run()
    assert replicas.asked == [(0, "load"), (0, "commit"), (0, "unload")]
    assert [a.error for a in replicas.answers["w"]] == [None, None]
    replicas.check_settled()


def test_a_load_one_replica_refuses_is_discarded_on_the_others() -> None:
    replicas = Replicas(3)
    replicas.unreadable.add((2, "x"))
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    (answer,) = replicas.answers["w"]
    assert answer.error is not None and answer.error.kind is ErrorKind.INVALID_REQUEST
    assert "x is unreadable" in answer.error.message and answer.lora_id is None
    assert replicas.asked[-2:] == [(1, "discard"), (0, "discard")]  # replica 0 frees it last
    replicas.check_settled()
    assert "x" not in replicas.named(0)
    with pytest.raises(NotFoundError):
        run_request(replicas.schedulers[1], 2)
    # Refused by replica 0, it goes no further.
    replicas.unreadable = {(0, "x")}
    replicas.asked.clear()
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert replicas.asked == [(0, "load")] and replicas.answers["w"][-1].error is not None
    # Loaded at last, under an id never taken before: no prefix of another load is found.
    replicas.unreadable.clear()
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert replicas.answers["w"][-1].error is None
    assert [replicas.named(r)["x"] for r in range(3)] == [4, 4, 4]
    replicas.check_settled()


def test_an_unload_removes_it_everywhere_replica_0_first() -> None:
    replicas = Replicas(3)
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    replicas.asked.clear()
    replicas.ask("w", "unload", "x")
    replicas.run()
    assert replicas.asked == [(0, "unload"), (1, "unload"), (2, "unload")]
    assert replicas.answers["w"][-1].error is None
    replicas.check_settled()
    assert "x" not in replicas.named(0)
    replicas.ask("w", "unload", "x")
    replicas.run()
    error = replicas.answers["w"][-1].error
    assert error is not None and error.kind is ErrorKind.NOT_FOUND
    replicas.ask("w", "commit", "x")  # a frontend asks for loads and unloads only
    error = replicas.answers["w"][-1].error
    assert error is not None and error.param == "action"


@pytest.mark.parametrize("seed", range(300))
def test_concurrent_changes_leave_the_replicas_agreeing(seed: int) -> None:
    """Batches of two or three workers loading and unloading one name (and another) at once,
    their messages delivered in a random order, some refused by one executor, sometimes with
    one replica's executor replaced meanwhile: whatever the outcome, every change is answered
    and no load is left half-done; the replicas agree (after one that lost adapters with its
    executor had them unloaded). While only loads run, nothing is named anywhere before
    every replica holds it."""
    rng = random.Random(seed)
    workers = ("w0", "w1", "w2", "w3")
    replicas = Replicas(3, workers)
    for _ in range(5):
        replicas.unreadable = {(rng.randrange(3), "x")} if rng.random() < 0.3 else set()
        actions = rng.choice([["load"], ["load", "unload"]])
        for worker in workers[: rng.randrange(2, 5)]:
            action = rng.choice(actions)
            name = "y" if rng.random() < 0.2 else "x"
            replicas.ask(worker, action, name, f"/{name}-{worker}" if action == "load" else None)
        replace_at = rng.randrange(40) if rng.random() < 0.2 else None
        slow = rng.choice([None, 0, 1, 2])  # a replica whose scheduler reads only when idle
        for delivered in itertools.count():
            if delivered == replace_at:
                replicas.replace_executor(rng.randrange(3))
            if not replicas.wire:
                break
            replicas.deliver(replicas.pick(rng, slow))
            if actions == ["load"] and replace_at is None:
                for replica, other in itertools.product(range(3), repeat=2):
                    named = set(replicas.named(replica).items())
                    assert named <= replicas.held_or_named(other), (replica, other)
        if replace_at is not None:
            for name in ("x", "y"):
                replicas.ask("w0", "unload", name)
                replicas.run()
        replicas.check_settled()
        if "x" in replicas.named(0):  # named by a load that answered success
            loaded = [a.lora_id for answers in replicas.answers.values() for a in answers]
            assert replicas.named(0)["x"] in loaded


def test_a_replica_that_does_not_answer_fails_the_load_and_the_others_discard_it() -> None:
    replicas = Replicas(3)
    replicas.ask("w", "load", "x", "/x")
    replicas.run(skip=1)  # replica 1's scheduler is stuck
    assert not replicas.answers["w"]
    replicas.fanouts["w"].expire(now=LORA_LOAD_TIMEOUT_S)
    (answer,) = replicas.answers["w"]
    assert answer.error is not None and answer.error.kind is ErrorKind.UNAVAILABLE
    assert "replicas [1] did not answer" in answer.error.message
    replicas.run()  # replica 1 again: its late load is discarded with the rest
    replicas.check_settled()
    assert "x" not in replicas.named(1)


@pytest.mark.parametrize("late", ["read-then-discard", "discard-then-read"])
def test_a_load_past_its_deadline_before_replica_0_named_its_id_frees_the_name(late: str) -> None:
    """Replica 0's executor still reads when the load times out: the worker knows no id, so
    replica 0 finds the load by its request, whether the read ends before the discard comes or
    after; the name can be loaded again."""
    replicas = Replicas(2)
    replicas.ask("w", "load", "x", "/x")
    replicas.deliver(("scheduler", 0, "w"))  # its executor is reading
    replicas.fanouts["w"].expire(now=LORA_LOAD_TIMEOUT_S)
    assert "replicas [0] did not answer" in replicas.answers["w"][0].error.message  # type: ignore[union-attr]
    if late == "discard-then-read":
        replicas.deliver(("scheduler", 0, "w"))
    replicas.run()
    replicas.check_settled()
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert replicas.answers["w"][-1].error is None and "x" in replicas.named(1)


def test_a_restarted_first_scheduler_names_ids_above_those_it_gave_before() -> None:
    """Replica 0's scheduler restarts (its registry starts from the clock, here 100): the
    other replica's adapter, taken under an older id, can still be unloaded, then loaded again
    everywhere under a new one."""
    replicas = Replicas(2)
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert replicas.named(1)["x"] == 2
    modules = parse_lora_modules(("static=/static",))
    restarted = LoraRegistry(modules, first_runtime_id=100)
    replicas.controls[0] = LoraControl(
        restarted, True, 0, functools.partial(replicas._to_worker, 0)
    )
    replicas.schedulers[0] = make_scheduler(max_loras=4)
    replicas.controls[0].adopt(replicas.schedulers[0], "base")
    replicas.ask("w", "unload", "x")  # replica 0 knows none; replica 1's is older than 100
    replicas.run()
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert [a.error for a in replicas.answers["w"]] == [None, None, None]
    assert replicas.named(0)["x"] == replicas.named(1)["x"] == 100
    replicas.check_settled()


def test_a_replaced_executor_loses_runtime_adapters_on_its_replica_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its replica forgets them (logged), the frontends stop naming them, and an unload then a
    load bring them back everywhere."""
    replicas = Replicas(2)
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    replicas.schedulers[1] = make_scheduler(max_loras=4)
    with caplog.at_level(logging.WARNING):
        replicas.controls[1].adopt(replicas.schedulers[1], "base")
    assert "replica 1 has a new executor: LoRA adapters ['x'] are gone" in caplog.text
    with pytest.raises(NotFoundError, match="no LoRA adapter has id 2"):
        run_request(replicas.schedulers[1], 2)
    frontend = LoraListings([])
    for control in replicas.controls:
        registry = control.registry
        frontend.take(LoraAdapterListing(replica=control.replica, adapters=registry.listing(),
                                         version=registry.version))  # fmt: skip
    assert list(frontend.adapters) == ["static"] and frontend.holders("x") == [0]
    replicas.ask("w", "unload", "x")  # replica 1 has none: replica 0's unload answers
    replicas.run()
    replicas.ask("w", "load", "x", "/x")
    replicas.run()
    assert [a.error for a in replicas.answers["w"]] == [None, None, None]
    for listing in replicas.answers["w"][-1].listings:
        frontend.take(listing)
    assert frontend.adapters["x"].lora_id == 3 and frontend.holders("x") == [0, 1]
    replicas.check_settled()


def adapter(name: str, lora_id: int) -> LoraAdapterInfo:
    return LoraAdapterInfo(name=name, lora_id=lora_id, path=f"/{name}", parent="base")


def test_a_frontend_names_what_every_replica_lists_by_each_ones_newest_listing() -> None:
    frontend = LoraListings(parse_lora_modules(("static=/static",)))
    assert list(frontend.adapters) == ["static"]  # --lora-modules, until a replica says
    static, x, y = adapter("static", 1), adapter("x", 2), adapter("y", 3)
    frontend.take(LoraAdapterListing(replica=0, adapters=[static, x, y], version=10))
    assert list(frontend.adapters) == ["static", "x", "y"]
    frontend.take(LoraAdapterListing(replica=1, adapters=[static, adapter("x", 4)], version=5))
    assert list(frontend.adapters) == ["static"]  # x under another id; no y on replica 1
    frontend.take(LoraAdapterListing(replica=1, adapters=[static, x, y], version=7))
    frontend.take(LoraAdapterListing(replica=1, adapters=[static], version=6))  # overtaken
    assert list(frontend.adapters) == ["static", "x", "y"]
    assert frontend.holders("y") == [0, 1] and frontend.holders("nope") == []
