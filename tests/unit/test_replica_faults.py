"""Engine replicas as failure domains: which replicas a frontend counts as down, from the
components it sees fail, and which tokenizer workers still have to hear it."""

from __future__ import annotations

from services.frontend.engine.replica_faults import ReplicaFaults
from shared.config import Config
from shared.replicas import replica_of

THREE = Config().replace(data_parallel_size=3)


def test_replica_of_names_each_engine_process_and_nothing_else() -> None:
    assert [replica_of(name, THREE) for name in ("r0-scheduler", "r2-executor-0")] == [0, 2]
    for other in ("frontend", "tokenizer-0", "scheduler", "r3-scheduler", "r1-executor-1"):
        assert replica_of(other, THREE) is None
    assert replica_of("executor-0", Config()) == 0


def test_an_exit_is_a_replicas_only_with_several_replicas() -> None:
    faults = ReplicaFaults(THREE)
    assert faults.exit("r1-executor-0", -9)
    assert not faults.exit("tokenizer-0", 1)  # not an engine process: the engine is lost
    assert not ReplicaFaults(Config()).exit("executor-0", -9)
    assert faults.exited == {"r1-executor-0": "r1-executor-0 exited with code -9"}


def test_replicas_down_are_those_with_a_failing_component() -> None:
    faults = ReplicaFaults(THREE)
    assert not faults.judge({}) and faults.down == {}
    faults.exit("r2-scheduler", -9)
    assert faults.judge({"r2-executor-0": "gone", "r0-executor-0": "stalled", "tokenizer-0": "x"})
    # the first of a replica's components by name gives its reason
    assert faults.down == {0: "stalled", 2: "gone"}
    assert not faults.judge({"r2-executor-0": "gone", "r0-executor-0": "stalled"})
    assert faults.judge({"r2-executor-0": "gone"})  # replica 0 is back
    assert faults.down == {2: "gone"}


def test_each_worker_hears_each_change_once() -> None:
    faults = ReplicaFaults(THREE)
    assert faults.to_tell(["tokenizer-0"]) == []  # nothing has been down: nothing to say
    faults.judge({"r1-scheduler": "gone"})
    assert faults.to_tell(["tokenizer-0", "tokenizer-1"]) == ["tokenizer-0", "tokenizer-1"]
    assert faults.to_tell(["tokenizer-0", "tokenizer-1", "tokenizer-2"]) == ["tokenizer-2"]
    faults.judge({})  # back: every worker hears that too
    assert faults.to_tell(["tokenizer-0", "tokenizer-1"]) == ["tokenizer-0", "tokenizer-1"]
