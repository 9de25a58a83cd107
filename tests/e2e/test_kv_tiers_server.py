"""The prefix cache's host and disk tiers through `kvflow serve`: the scheduler keeps the books
and the executor moves the bytes, in processes of their own. Prompts that outgrow a small GPU
pool and a smaller host tier come back from the disk tier with the tokens they got when first
computed, and a restarted server reads the first one's directory from its first request."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.server import Server, start_server

MODEL = "SmolLM2-135M-Instruct"
# The embedded model's KV block on the CPU: 30 layers x K, V x 3 heads x 64 dims x 4 bytes x
# 16 tokens = 720 KiB. The host tier holds 2 of them, the GPU pool 8.
BLOCK_BYTES = 30 * 2 * 3 * 64 * 4 * 16
PROMPTS = [[(37 * n + 101 * k) % 9000 + 100 for n in range(50)] for k in range(4)]


def tiered(directory: Path) -> Server:
    return start_server(
        "--num-gpu-blocks-override", "8", "--max-num-seqs", "1",
        "--kv-offloading-size", str(2 * BLOCK_BYTES / 2**30),
        "--kv-offloading-disk-path", str(directory), "--kv-offloading-disk-size", "0.05",
    )  # fmt: skip


def complete(server: Server, prompt: list[int]) -> str:
    result = server.client().completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, temperature=0
    )
    return result.choices[0].text


def test_prompts_come_back_from_disk_and_across_a_restart(tmp_path: Path) -> None:
    server = tiered(tmp_path)
    try:
        first = [complete(server, prompt) for prompt in PROMPTS]
        again = complete(server, PROMPTS[0])  # its blocks left the GPU and the host tier
        metrics = server.wait_idle()
    finally:
        server.stop()
    assert server.proc.returncode == 0
    assert again == first[0]
    assert metrics["kv_offload_bytes_to_disk_total"] > 0
    assert metrics["kv_offload_bytes_from_disk_total"] > 0
    assert metrics["kv_offload_disk_misses_total"] == 0
    assert metrics["kv_offload_disk_write_seconds_total"] > 0
    assert metrics["kv_offload_disk_read_seconds_total"] > 0
    restarted = tiered(tmp_path)
    try:
        assert complete(restarted, PROMPTS[1]) == first[1]
        assert restarted.wait_idle()["kv_offload_bytes_from_disk_total"] > 0
    finally:
        restarted.stop()
