"""`kvflow serve --tensor-parallel-size N` on CPU (gloo): the embedded SmolLM2 (9 query, 3 KV
heads) on three ranks serves the greedy tokens of one process; a rank that dies mid-run ends
the requests in flight with an error, /health fails and serve exits non-zero; two ranks, which
its heads do not allow, are refused by name before any rank starts."""

from __future__ import annotations

import os
import subprocess
import sys

from kvflow import LLM, SamplingParams
from tests.e2e.server import start_server
from tests.e2e.test_failures import kill_mid_run

PROMPTS = ["The capital of France is", "List three colours:"]


def rank_pid(executor: int, rank: int) -> int:
    out = subprocess.run(
        ["pgrep", "-P", str(executor), "-f", f"rank_group .*--rank {rank} "],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert out, f"no executor rank {rank} under the executor"
    return int(out[0])


def test_three_ranks_serve_the_tokens_of_one_and_die_together(smollm2: LLM) -> None:
    expected = [  # one process: the session's SmolLM2 (float32 on CPU, as `serve` defaults to)
        result.outputs[0].text
        for result in smollm2.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        )
    ]
    server = start_server("--tensor-parallel-size", "3")
    try:
        client = server.client()
        for prompt, text in zip(PROMPTS, expected, strict=True):
            completion = client.completions.create(
                model="SmolLM2-135M-Instruct",
                prompt=prompt,
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert completion.choices[0].text == text

        kill_mid_run(server, lambda: rank_pid(server.child_pid("executor"), 1))
    finally:
        server.stop()


def test_a_split_the_heads_do_not_allow_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVFLOW_")}
    argv = [sys.executable, "-m", "services", "executor", "--tensor-parallel-size", "2"]
    argv += ["--scheduler-address", "ipc:///nonexistent/s", "--frontend-address", "ipc:///x/f"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "9 query heads do not split 2 ways" in done.stderr
    assert "[executor-1]" not in done.stderr  # no other rank was started
