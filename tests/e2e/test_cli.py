"""`kvflow generate` as a user runs it: a real subprocess on the embedded model."""

from __future__ import annotations

import json
import subprocess
import sys


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_on_the_embedded_model() -> None:
    done = run_cli(
        "generate",
        "--prompt",
        "The capital of France is",
        "--prompt",
        "2 + 2 =",
        "--max-tokens",
        "8",
        "--json",
        "--max-model-len",
        "512",
    )
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["The capital of France is", "2 + 2 ="]
    assert lines[0]["text"].startswith(" Paris")
    for line in lines:
        assert set(line) == {"prompt", "text", "token_ids", "finish_reason"}
        assert 1 <= len(line["token_ids"]) <= 8
        assert line["finish_reason"] in ("stop", "length")
    assert "KV cache" in done.stderr  # startup logs say how much KV fits


def test_bad_flag_value_is_a_clear_error() -> None:
    done = run_cli("generate", "--prompt", "hi", "--temperature", "-1")
    assert done.returncode == 2
    assert "temperature" in done.stderr and "Traceback" not in done.stderr
    done = run_cli("generate", "--prompt", "hi", "--block-size", "7")
    assert done.returncode == 2 and "--block-size" in done.stderr


def test_help_lists_vllm_style_flags() -> None:
    done = run_cli("generate", "--help")
    for flag in (
        "--max-model-len",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--enable-prefix-caching",
        "--no-enable-prefix-caching",
        "--block-size",
        "--gpu-memory-utilization",
        "--dtype",
        "--load-format",
        "--json",
        "--chat",
    ):
        assert flag in done.stdout
