"""Handovers under tensor parallelism, two gloo ranks in processes of their own: each rank
fetches its own heads from the same rank of the prefill engine (its own address), and the
ranks agree on each fetch's fate, so a fetch that fails on one rank fails on both (the rank
that answers the scheduler, rank 0, reports it for all)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner import kv_exports
from services.executor.runner.host_kv import HostKVPool
from services.executor.runner.kv_exports import KVExports
from services.executor.runner.kv_handover import Handover, rank_address
from services.executor.runner.kv_imports import KVImports
from shared.protocol import KVExport, KVImport, ModelRunnerOutput, SchedulerOutput
from shared.wire_security import LOCAL


def plan(step: int, request_id: str) -> SchedulerOutput:
    imports = [KVImport(request_id, 0, 0, [3, 1])]
    return SchedulerOutput(
        step=step,
        new_requests=[],
        cached_requests=[],
        num_scheduled_tokens={},
        finished_request_ids=[],
        kv_imports=imports,
    )


def rank_main(rank: int, folder: str) -> None:
    kv_exports.EXPORT_WAIT_S = 0.2  # an export that never comes is given up on soon
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
    tp = TensorParallel(rank=rank, size=2)
    generator = torch.Generator().manual_seed(rank)
    source = [torch.randn(2, 6, 4, 1, 8, generator=generator) for _ in range(2)]  # its heads
    target = [torch.zeros(2, 6, 4, 1, 8) for _ in range(2)]
    address = rank_address(f"ipc://{folder}/kv", rank)
    exports = KVExports(HostKVPool(source, 4), address, LOCAL, None)
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, f"decode-{rank}")
    handover = Handover(None, imports, tp, torch.device("cpu"))
    exports.add([KVExport("both", [4, 5])])
    if rank == 1:  # rank 0's copy of this one never comes
        exports.add([KVExport("one", [4, 5])])
    results = {}
    for step, request_id in ((1, "both"), (2, "one")):
        handover.run(plan(step, request_id))
        output = ModelRunnerOutput(step=step, sampled={})
        handover.report(output)
        results[request_id] = output.kv_import_failed
    results["own_heads"] = all(
        torch.equal(s[:, [4, 5]], t[:, [3, 1]]) for s, t in zip(source, target, strict=True)
    )
    Path(folder, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def test_each_rank_fetches_its_own_heads_and_the_ranks_agree_on_failures(tmp_path: Path) -> None:
    module = "tests.integration.test_kv_handover_ranks"
    ranks = [
        subprocess.Popen([sys.executable, "-m", module, str(rank), str(tmp_path)])
        for rank in range(2)
    ]
    assert [rank.wait(timeout=120) for rank in ranks] == [0, 0]
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert results == {"both": [], "one": ["one"], "own_heads": True}, (rank, results)


if __name__ == "__main__":  # one rank: RANK FOLDER
    rank_main(int(sys.argv[1]), sys.argv[2])
