"""The prefix cache's disk tier (`--kv-offloading-disk-path`) end to end on the CPU: behind a
host tier too small for the conversations' histories, evicted prefixes come back from disk
with the tokens an engine without any tier gives; the directory serves a restarted engine,
and a corrupted or foreign file is a miss, never an error."""

from __future__ import annotations

import gc
import json
import threading
from pathlib import Path

import pytest
import torch

from kvflow import LLM
from services.executor.runner.disk_kv import HEADER, DiskKV
from services.launcher.cli import main
from shared.config import ConfigError
from tests.integration.test_host_kv_tier import SETTINGS, chat, conversations
from tests.integration.tp_generate import generate

BLOCK_BYTES = 8192  # the tiny Llama's block (test_host_kv_tier)
HOST_GIB = 4 * BLOCK_BYTES / 2**30  # a host tier of 4 blocks: what it drops is on disk
DISK_GIB = 256 * BLOCK_BYTES / 2**30
VARIANTS = {
    "one at a time": dict(num_gpu_blocks_override=12),
    "chunked prefill 16": dict(num_gpu_blocks_override=12, max_num_batched_tokens=16),
    "together, preempting": dict(num_gpu_blocks_override=12),
}


def tiered(model: Path, disk: Path, **settings: object) -> LLM:
    return LLM(
        str(model), kv_offloading_size=HOST_GIB, kv_offloading_disk_path=str(disk),
        kv_offloading_disk_size=DISK_GIB, **{**SETTINGS, **settings},
    )  # fmt: skip


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> dict[str, list[list[int]]]:
    """Each variant's tokens from an engine without a tier."""
    return {
        name: chat(LLM(str(tiny_llama_dir), **{**SETTINGS, **settings}), name.startswith("tog"))
        for name, settings in VARIANTS.items()
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_prefixes_read_from_disk_give_the_recomputed_tokens(
    tiny_llama_dir: Path, tmp_path: Path, expected: dict[str, list[list[int]]], variant: str
) -> None:
    llm = tiered(tiny_llama_dir, tmp_path, **VARIANTS[variant])
    assert chat(llm, variant.startswith("together")) == expected[variant]
    tier = llm.stats().host_tier
    assert tier is not None and tier.num_blocks == 4 and tier.num_disk_blocks == 256
    assert tier.blocks_to_disk > 0 and tier.blocks_from_disk > 0 and tier.disk_misses == 0
    llm.engine.scheduler.check_invariants()


def test_a_restarted_engine_reads_the_directory(
    tiny_llama_dir: Path, tmp_path: Path, expected: dict[str, list[list[int]]]
) -> None:
    """The second engine finds the first one's conversations on disk from its first turn."""
    first = tiered(tiny_llama_dir, tmp_path, **VARIANTS["one at a time"])
    chat(first, together=False)
    written = first.stats().host_tier.blocks_to_disk  # type: ignore[union-attr]
    del first
    gc.collect()
    assert len(list((tmp_path / "replica0-rank0").glob("*.kv"))) == written
    second = tiered(tiny_llama_dir, tmp_path, **VARIANTS["one at a time"])
    assert chat(second, together=False) == expected["one at a time"]
    tier = second.stats().host_tier
    assert tier is not None and tier.blocks_from_disk > 0
    assert tier.blocks_to_disk < written  # what it found there is not written again


def test_corrupted_files_are_misses(
    tiny_llama_dir: Path, tmp_path: Path, expected: dict[str, list[list[int]]]
) -> None:
    first = tiered(tiny_llama_dir, tmp_path, **VARIANTS["one at a time"])
    chat(first, together=False)
    del first
    gc.collect()
    files = sorted((tmp_path / "replica0-rank0").glob("*.kv"))
    for index, path in enumerate(files):
        data = bytearray(path.read_bytes())
        if index % 2:
            data[HEADER.size + index] ^= 0xFF  # a flipped byte: the checksum fails
        else:
            data = data[: len(data) // 2]  # cut short
        path.write_bytes(bytes(data))
    second = tiered(tiny_llama_dir, tmp_path, **VARIANTS["one at a time"])
    assert chat(second, together=False) == expected["one at a time"]
    tier = second.stats().host_tier
    # Every file was spoilt: each read of one is a miss (those read later were written again)
    assert tier is not None and 0 < tier.disk_misses <= len(files)
    second.engine.scheduler.check_invariants()


def test_another_layout_does_not_read_the_files(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Files written under another manifest (here: an FP8 cache) are deleted at start."""
    first = tiered(tiny_llama_dir, tmp_path, **VARIANTS["one at a time"])
    chat(first, together=False)
    del first
    gc.collect()
    with caplog.at_level("INFO"):
        second = tiered(tiny_llama_dir, tmp_path, kv_cache_dtype="fp8", num_gpu_blocks_override=12)
    assert "written for another model or layout: deleted" in caplog.text
    assert second.engine.scheduler.kv.disk is not None
    assert len(second.engine.scheduler.kv.disk) == 0


def test_the_directory_keeps_whole_files_only(tmp_path: Path) -> None:
    """The executor's side alone: a write is read back bit for bit; a tmp file left by a
    crash is removed at start, and a missing file is a miss."""
    slots = torch.zeros(3, 2, 8, dtype=torch.uint8)
    manifest = {"model": "x"}
    disk = DiskKV(tmp_path, manifest, slots)
    rows = torch.randint(0, 255, (2, 2, 8), dtype=torch.uint8)
    keys = [bytes([1]) * 32, bytes([2]) * 32]
    disk.write(keys, rows, None)
    (tmp_path / f"{bytes([3]).hex() * 32}.tmp").write_bytes(b"half a write")
    disk.read([(keys[1], 0), (keys[0], 2), (bytes([4]) * 32, 1)], None)
    assert reported(disk, 3) == ({keys[1], keys[0]}, {bytes([4]) * 32})
    assert torch.equal(slots[0], rows[1]) and torch.equal(slots[2], rows[0])
    assert disk.held() == keys
    with pytest.raises(RuntimeError, match="in use by another engine"):
        DiskKV(tmp_path, manifest, slots)
    disk.close()
    again = DiskKV(tmp_path, manifest, slots)
    assert again.held() == keys and not list(tmp_path.glob("*.tmp"))
    again.delete([keys[0]])
    assert again.held() == [keys[1]]
    again.close()


def reported(disk: DiskKV, count: int) -> tuple[set[bytes], set[bytes]]:
    """The (read, missed) keys of the next `count` reads, reported by steps that ran nothing
    else (each waits for one)."""
    loaded: set[bytes] = set()
    failed: set[bytes] = set()
    while len(loaded) + len(failed) < count:
        done, missed = disk.report(idle=True)
        loaded.update(done)
        failed.update(missed)
    return loaded, failed


class Gate:
    """Stands for the CUDA event a read waits for (the device's earlier work on its slot):
    the read starts once the test opens it."""

    def __init__(self) -> None:
        self.open = threading.Event()

    def synchronize(self) -> None:
        self.open.wait()


def test_a_read_is_reported_with_the_first_step_after_it_is_done(tmp_path: Path) -> None:
    """A step that computed rows does not wait for a read still out (nothing of the read holds
    up other requests' tokens); it comes with a later step's report, once done; a step that
    ran nothing else waits for it."""
    slots = torch.zeros(2, 8, dtype=torch.uint8)
    disk = DiskKV(tmp_path, {"model": "x"}, slots)
    rows, key = torch.arange(8, dtype=torch.uint8)[None], bytes([9]) * 32
    disk.write([key], rows, None)
    disk.drain()
    gate = Gate()
    disk.read([(key, 1)], gate)
    assert disk.report() == ([], [])  # a step with rows: not done, not waited for
    assert disk.report() == ([], [])
    gate.open.set()
    assert reported(disk, 1) == ({key}, set())
    assert torch.equal(slots[1], rows[0])
    assert disk.report(idle=True) == ([], [])  # nothing out: an idle step does not wait
    disk.close()


def test_the_multi_turn_bench_counts_the_disk_reads(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """`kvflow bench multi-turn` with a disk tier behind the host tier: later turns read
    blocks back from disk, and each turn says how many."""
    out = tmp_path / "multi_turn.json"
    argv = ["bench", "multi-turn", str(tiny_llama_dir), "--device", "cpu", "--dtype", "float32"]
    argv += ["--conversations", "4", "--turns", "3", "--first-len", "60", "--turn-len", "10"]
    argv += ["--output-len", "4", "--num-gpu-blocks-override", "12", "--max-model-len", "256"]
    argv += ["--kv-offloading-size", str(HOST_GIB), "--output-json", str(out)]
    argv += ["--kv-offloading-disk-path", str(tmp_path / "disk")]
    argv += ["--kv-offloading-disk-size", str(DISK_GIB)]
    assert main(argv) == 0
    turns = json.loads(out.read_text())["turns"]
    assert turns[0]["blocks_to_disk"] > 0 and turns[0]["blocks_from_disk"] == 0
    assert sum(t["blocks_from_disk"] for t in turns[1:]) > 0


def test_flags_that_do_not_fit_are_refused(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs both --kv-offloading-disk-path and"):
        LLM(str(tiny_llama_dir), kv_offloading_size=1.0, kv_offloading_disk_path=str(tmp_path))
    with pytest.raises(ConfigError, match="behind the host tier: it needs --kv-offloading-size"):
        LLM(str(tiny_llama_dir), kv_offloading_disk_path=str(tmp_path), kv_offloading_disk_size=1)


def test_two_ranks_agree_on_every_read(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--tensor-parallel-size 2 over gloo: each rank writes and reads its own heads' files.
    A restarted engine finds them; where one rank's files are all corrupted, its misses are
    both ranks' (else the other rank's heads would restore what this one's did not), and the
    tokens are still one rank's without any tier."""
    first = conversations(num=4)
    prompts = [c[0] for c in first] + [first[0][0] + first[0][1], first[1][0] + first[1][1]]
    settings = dict(num_gpu_blocks_override=8, max_num_seqs=1, block_size=16, max_model_len=256)
    expected = generate(tmp_path / "one", 1, str(tiny_llama_dir), prompts, 6, **settings)
    tiers = dict(
        kv_offloading_size=HOST_GIB, kv_offloading_disk_path=str(tmp_path / "disk"),
        kv_offloading_disk_size=DISK_GIB,
    )  # fmt: skip
    for run in ("written", "read again", "one rank corrupted"):
        if run == "one rank corrupted":
            for path in (tmp_path / "disk" / "replica0-rank1").glob("*.kv"):
                path.write_bytes(path.read_bytes()[:-1] + b"?")
        out = tmp_path / run.replace(" ", "-")
        assert generate(out, 2, str(tiny_llama_dir), prompts, 6, **tiers, **settings) == expected
        tier = json.loads((out / "host_tier.json").read_text())
        wanted = {"written": "blocks_to_disk", "read again": "blocks_from_disk"}
        assert tier[wanted.get(run, "disk_misses")] > 0
