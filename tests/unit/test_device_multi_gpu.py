"""scripts/device_multi_gpu.sh without a GPU (DRY_RUN=1): every kvflow command it would run
parses into a valid engine config, and every part it asks the other device scripts for is
one they have."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from services.launcher.cli import build_parser
from shared.config import OFFLINE_DEFAULTS, config_from_args

ROOT = Path(__file__).parents[2]
PARTS = "tp dp ep ep-dp pd tp-vllm ep-vllm summary"


def dry_run(gpus: int) -> list[list[str]]:
    env = {**os.environ, "DRY_RUN": "1", "N": str(gpus), "PARTS": PARTS}
    out = subprocess.run(
        ["bash", "scripts/device_multi_gpu.sh"], cwd=ROOT, env=env, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    return [shlex.split(line[4:]) for line in out.splitlines() if line.startswith("=== ")]


def test_every_kvflow_command_makes_a_valid_config() -> None:
    commands = [c for c in dry_run(2) if c[:3] == ["python3", "-m", "services"]]
    # throughput and latency on one GPU and with EP over two ranks; throughput with EP over
    # two replicas, with CUDA graphs and eagerly
    assert len(commands) == 6
    for command in commands:
        args = build_parser().parse_args(command[3:])
        config = config_from_args(args, defaults=OFFLINE_DEFAULTS)
        if "--enable-expert-parallel" in command:
            assert config.enable_expert_parallel
            assert 2 in (config.tensor_parallel_size, config.data_parallel_size)
    across_replicas = [c for c in commands if "--data-parallel-size" in c]
    assert sorted("--enforce-eager" in c for c in across_replicas) == [False, True]


def test_every_part_asked_of_the_other_scripts_is_theirs() -> None:
    asked = [
        (command[-1], part)
        for command in dry_run(4)
        if command[0] == "env"
        for setting in command
        if setting.startswith("PARTS=")
        for part in setting.removeprefix("PARTS=").split()
    ]
    assert {script for script, _ in asked} == {
        "scripts/device_bench.sh", "scripts/device_serve.sh",
    }  # fmt: skip
    for script, part in asked:
        cases = (ROOT / script).read_text()
        assert re.search(rf"^\s+{re.escape(part)}\)", cases, re.MULTILINE), (script, part)
