"""The executors' half of prefill/decode disaggregation (services/executor/runner/
kv_handover.py) on CPU caches: a prefill rank's exports fetched by a decode rank over a real
ZeroMQ socket, as bytes in pieces or from the shared-memory slots, land byte for byte in the
blocks asked for, in any cache dtype; an export is fetched once, the oldest goes when the
slots are full (never one lent to a shared fetch), and a fetch that cannot be answered
(dropped, never made, nobody there) is an error, never wrong bytes."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from services.executor.parallel.tensor_parallel import TensorParallel
from services.executor.runner import kv_exports, kv_imports
from services.executor.runner.host_kv import HostKVPool
from services.executor.runner.kv_exports import KVExports, bind_address
from services.executor.runner.kv_handover import Handover, rank_address
from services.executor.runner.kv_imports import KVImports
from shared.protocol import (
    CudaSlots,
    KVExport,
    KVFetch,
    KVImport,
    ModelRunnerOutput,
    SchedulerOutput,
)
from shared.wire_security import LOCAL

NUM_BLOCKS = 12


def caches(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.Tensor]:
    """Three layers of [2, blocks, block_size 4, 2 heads, head_dim 8]."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, 4, 2, 8, generator=generator).to(dtype) for _ in range(3)]


def same_blocks(
    a: list[torch.Tensor], a_ids: list[int], b: list[torch.Tensor], b_ids: list[int]
) -> bool:
    return all(
        torch.equal(x.view(torch.uint8)[:, a_ids], y.view(torch.uint8)[:, b_ids])
        for x, y in zip(a, b, strict=True)
    )


@pytest.fixture
def address(tmp_path: Path) -> Iterator[str]:
    yield f"ipc://{tmp_path}/kv-transfer-0"


def test_an_export_lands_byte_for_byte_in_the_blocks_asked_for(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_imports, "FETCH_BYTES", 1)  # a piece per block
    source, target = caches(seed=1), caches(seed=2)
    exports = KVExports(HostKVPool(source, 8), address, LOCAL, None)
    exports.add([KVExport("a", [5, 1, 3, 9])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    # Blocks 1.. of the export (its first the decode engine held already).
    assert imports.load(KVImport("a", 0, 1, [7, 2, 0])) is None
    assert same_blocks(source, [1, 3, 9], target, [7, 2, 0])
    assert not same_blocks(source, [5], target, [4])
    # Fetched to its end, it is gone.
    error = imports.load(KVImport("a", 0, 0, [4]))
    assert error is not None and "no export" in error


def test_an_fp8_cache_moves_as_bytes(address: str) -> None:
    source, target = caches(torch.float8_e4m3fn, 1), caches(torch.float8_e4m3fn, 2)
    exports = KVExports(HostKVPool(source, 4), address, LOCAL, None)
    exports.add([KVExport("a", [0, 11])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    assert imports.load(KVImport("a", 0, 0, [3, 4])) is None
    assert same_blocks(source, [0, 11], target, [3, 4])


def test_the_oldest_export_goes_when_the_slots_are_full(
    address: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_exports, "EXPORT_WAIT_S", 30.0)  # a dropped one answers at once
    source, target = caches(seed=1), caches(seed=2)
    exports = KVExports(HostKVPool(source, 4), address, LOCAL, None)
    exports.add([KVExport("old", [0, 1, 2]), KVExport("new", [3, 4])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    error = imports.load(KVImport("old", 0, 0, [5, 6, 7]))
    assert error is not None and "no export" in error
    assert imports.load(KVImport("new", 0, 0, [5, 6])) is None
    assert same_blocks(source, [3, 4], target, [5, 6])


def test_a_fetch_nobody_answers_fails_and_the_next_one_works(
    address: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kv_imports, "FETCH_TIMEOUT_S", 0.3)
    monkeypatch.setattr(kv_exports, "EXPORT_WAIT_S", 0.05)
    source, target = caches(seed=1), caches(seed=2)
    nobody = f"ipc://{tmp_path}/nobody"
    imports = KVImports(HostKVPool(target, 0), [nobody, address], LOCAL, "decode")
    error = imports.load(KVImport("a", 0, 0, [1]))
    assert error is not None and "did not answer" in error
    exports = KVExports(HostKVPool(source, 4), address, LOCAL, None)
    error = imports.load(KVImport("never", 1, 0, [1]))  # no such export: it waited, then said so
    assert error is not None and "no export" in error
    exports.add([KVExport("a", [2])])
    assert imports.load(KVImport("a", 1, 0, [1])) is None
    assert same_blocks(source, [2], target, [1])
    assert imports.load(KVImport("a", 2, 0, [1])) == "no prefill replica 2"


def test_one_host_reads_the_blocks_in_the_shared_slots(address: str, tmp_path: Path) -> None:
    source, target = caches(seed=1), caches(seed=2)
    shared = str(tmp_path / "kvflow-kv-slots")
    pool = HostKVPool(source, 6, shared)
    exports = KVExports(pool, address, LOCAL, shared)
    exports.add([KVExport("a", [4, 5, 6, 7]), KVExport("b", [1])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    assert imports.load(KVImport("a", 0, 1, [0, 2, 9])) is None
    assert same_blocks(source, [5, 6, 7], target, [0, 2, 9])
    assert imports.load(KVImport("b", 0, 0, [3])) is None  # no bytes came over the socket
    assert same_blocks(source, [1], target, [3])
    error = imports.load(KVImport("a", 0, 1, [0, 2, 9]))  # released: gone
    assert error is not None and "no export" in error


def test_slots_lent_to_a_shared_fetch_are_not_dropped(
    address: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = caches(seed=1)
    shared = str(tmp_path / "kvflow-kv-slots")
    exports = KVExports(HostKVPool(source, 4, shared), address, LOCAL, shared)
    exports.add([KVExport("lent", [0, 1, 2])])
    imports = KVImports(HostKVPool(caches(seed=2), 0), [address], LOCAL, "decode")
    reply, _ = imports._ask(0, KVFetch("lent", 0, 3, shared=True))  # lent, not released yet
    assert reply.slots and not reply.error
    exports.add([KVExport("new", [3, 4])])  # no room: the lent one stays, this one is refused
    error = imports.load(KVImport("new", 0, 0, [5, 6]))
    assert error is not None and "no export" in error


def test_a_restarted_prefill_rank_is_read_in_its_new_file(address: str, tmp_path: Path) -> None:
    target = caches(seed=3)
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    for seed, name in ((1, "before"), (2, "after")):  # the same address, a new file each time
        source, shared = caches(seed=seed), str(tmp_path / f"kvflow-kv-{name}")
        exports = KVExports(HostKVPool(source, 4, shared), address, LOCAL, shared)
        exports.add([KVExport(name, [0, 1])])
        assert imports.load(KVImport(name, 0, 0, [5, 6])) is None
        assert same_blocks(source, [0, 1], target, [5, 6])
        assert imports._slabs[0][0] == shared
        exports.close()
        # A restart takes seconds, by which time ZMQ has seen the old connection drop; here the
        # next ask would come within microseconds and could go down the dropped connection
        # (lost, then a 5 s timeout: seen once under load). The decode rank reconnects first.
        imports._sockets.pop(0).close(linger=0)


def test_a_decode_rank_that_cannot_map_the_slots_gets_the_bytes(
    address: str, tmp_path: Path
) -> None:
    source, target = caches(seed=1), caches(seed=2)
    shared = str(tmp_path / "kvflow-kv-slots")
    exports = KVExports(HostKVPool(source, 4, shared), address, LOCAL, shared)
    exports.add([KVExport("a", [8, 9])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    imports._slabs[0] = (shared, None)  # as on another host
    assert imports.load(KVImport("a", 0, 0, [1, 2])) is None
    assert same_blocks(source, [8, 9], target, [1, 2])


def test_gpu_slots_a_decode_rank_cannot_open_come_as_bytes(address: str) -> None:
    """Slots in a GPU's memory (--kv-buffer-device cuda) that this rank cannot open by CUDA
    IPC (it does not see that GPU: here, no GPU at all) come as bytes."""
    source, target = caches(seed=1), caches(seed=2)
    exports = KVExports(HostKVPool(source, 4, on_device=True), address, LOCAL, None)
    exports.cuda_slots = CudaSlots(
        gpu_uuid="GPU-elsewhere", handle=b"handle", storage_bytes=1, storage_offset=0,
        ref_counter=b"", ref_counter_offset=0, event=b"", event_sync=False,
        shape=list(exports.pool.slots.shape),
    )  # fmt: skip
    exports.add([KVExport("a", [8, 9])])
    imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
    assert imports.load(KVImport("a", 0, 0, [1, 2])) is None
    assert same_blocks(source, [8, 9], target, [1, 2])
    assert imports._slabs[0] == (b"handle", None)


def test_a_silent_prefill_replica_is_not_asked_again_for_a_while(
    address: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(kv_imports, "FETCH_TIMEOUT_S", 0.2)
    imports = KVImports(HostKVPool(caches(), 0), [f"ipc://{tmp_path}/nobody"], LOCAL, "decode")
    error = imports.load(KVImport("a", 0, 0, [1]))
    assert error is not None and "did not answer in" in error
    error = imports.load(KVImport("b", 0, 0, [1]))  # at once, not after another timeout
    assert error is not None and "did not answer lately" in error


def test_a_fetch_that_breaks_or_has_no_fetcher_fails_its_request_alone(address: str) -> None:
    tp = TensorParallel()
    entry = KVImport("a", 0, 0, [1])
    plan = SchedulerOutput(
        step=3, new_requests=[], cached_requests=[], num_scheduled_tokens={},
        finished_request_ids=[], kv_imports=[entry],
    )  # fmt: skip
    imports = KVImports(HostKVPool(caches(), 0), [address], LOCAL, "decode")
    imports.load = lambda entry: 1 / 0  # type: ignore[method-assign,assignment,return-value]
    for handover in (
        Handover(None, imports, tp, torch.device("cpu")),
        Handover(None, None, tp, torch.device("cpu")),  # a prefill replica asked to import
    ):
        handover.run(plan)
        output = ModelRunnerOutput(step=3, sampled={})
        handover.report(output)
        assert output.kv_import_failed == ["a"]


def test_shared_slot_files_are_named_once_and_those_of_gone_processes_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(kv_exports, "SHARED_DIR", tmp_path)
    host = socket.gethostname()
    stale = tmp_path / f"kvflow-kv-{host}-999999999-0-abcd"  # no such process
    other_host = tmp_path / "kvflow-kv-another-host-999999999-0-abcd"  # not ours to judge
    stale.touch()
    other_host.touch()
    first, second = kv_exports.shared_slots_file(0, 4096), kv_exports.shared_slots_file(0, 4096)
    assert first and second and first != second
    assert Path(first).stat().st_size == 4096
    assert not stale.exists() and other_host.exists()


def test_rank_addresses() -> None:
    assert bind_address("tcp://kvflow-engine-0.kvflow-engine:5561") == "tcp://0.0.0.0:5561"
    assert bind_address("tcp://10.0.0.5:5560") == "tcp://10.0.0.5:5560"
    assert bind_address("tcp://localhost:5560") == "tcp://localhost:5560"
    assert bind_address("ipc:///run/kv-0") == "ipc:///run/kv-0"
    assert rank_address("tcp://10.0.0.5:5560", 0) == "tcp://10.0.0.5:5560"
    assert rank_address("tcp://10.0.0.5:5560", 3) == "tcp://10.0.0.5:5563"
    assert rank_address("ipc:///run/kv-0", 1) == "ipc:///run/kv-0-1"
