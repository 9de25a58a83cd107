"""A prefill rank's handover slots in GPU memory (--kv-buffer-device cuda), read by a decode
rank in another process by CUDA IPC: the blocks land byte for byte, device to device, and the
handle is opened once for every export after. Needs a CUDA GPU (CUDA IPC does not open
a handle in the process that made it, hence the exporter's own process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.executor.runner.host_kv import HostKVPool
from services.executor.runner.kv_imports import KVImports
from shared.protocol import KVImport
from shared.wire_security import LOCAL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ROOT = Path(__file__).resolve().parents[2]

# The prefill rank: two exports of blocks in its GPU slots, served until stdin closes.
EXPORTER = """
import sys
from services.executor.runner.host_kv import HostKVPool
from services.executor.runner.kv_exports import KVExports
from shared.protocol import KVExport
from shared.wire_security import LOCAL
from tests.integration.test_kv_handover_cuda import cuda_caches

pool = HostKVPool(cuda_caches(seed=1), 8, on_device=True)
exports = KVExports(pool, sys.argv[1], LOCAL, None)
exports.add([KVExport("a", [5, 1, 3, 9])])
print("ready", flush=True)
sys.stdin.readline()  # the decode rank has read "a"
exports.add([KVExport("b", [2, 8, 0])])
print("ready", flush=True)
sys.stdin.read()
"""


def cuda_caches(seed: int) -> list[torch.Tensor]:
    """Three bf16 layers of [2, 12 blocks, 16 tokens, 2 heads, 64], the same in any process."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 12, 16, 2, 64)
    return [torch.randn(shape, generator=generator).bfloat16().cuda() for _ in range(3)]


def same_blocks(
    a: list[torch.Tensor], a_ids: list[int], b: list[torch.Tensor], b_ids: list[int]
) -> bool:
    return all(torch.equal(x[:, a_ids], y[:, b_ids]) for x, y in zip(a, b, strict=True))


def test_gpu_slots_are_read_by_cuda_ipc_byte_for_byte(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/kv"
    exporter = subprocess.Popen(
        [sys.executable, "-c", EXPORTER, address],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert exporter.stdin is not None and exporter.stdout is not None
    try:
        source, target = cuda_caches(seed=1), cuda_caches(seed=2)
        imports = KVImports(HostKVPool(target, 0), [address], LOCAL, "decode")
        opened = []
        for name, blocks, into in (("a", [5, 1, 3, 9], [7, 2, 0, 4]), ("b", [2, 8, 0], [1, 3, 5])):
            assert exporter.stdout.readline().strip() == "ready"
            assert imports.load(KVImport(name, 0, 0, into)) is None
            torch.cuda.synchronize()
            assert same_blocks(source, blocks, target, into)
            opened.append(imports._slabs[0][1])
            assert opened[-1] is not None and opened[-1].is_cuda  # by CUDA IPC, not as bytes
            exporter.stdin.write("read\n")
            exporter.stdin.flush()
        assert opened[0] is opened[1]
    finally:
        exporter.stdin.close()
        assert exporter.wait(timeout=60) == 0
