"""scripts/device_moe.sh without a GPU (DRY_RUN=1): every kvflow engine command it would run
parses into a valid engine config (FP8 where its name says so), `bench moe` takes its flags,
and every part it asks of scripts/device_serve.sh is one that script has."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from services.launcher.cli import build_parser
from shared.config import OFFLINE_DEFAULTS, config_from_args

ROOT = Path(__file__).parents[2]
PARTS = "tests kvflow install-vllm vllm layer gpt-oss kvflow-profile vllm-profile b1-profile"


def dry_run() -> list[list[str]]:
    env = {**os.environ, "DRY_RUN": "1", "PARTS": PARTS}
    out = subprocess.run(
        ["bash", "scripts/device_moe.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    return [shlex.split(line.split(" ", 2)[2]) for line in out.splitlines() if line[:4] == "=== "]


def test_every_engine_command_makes_a_valid_config() -> None:
    commands = [c for c in dry_run() if c[:3] == ["python3", "-m", "services"]]
    engines = [c for c in commands if c[4] in ("latency", "throughput")]
    # Qwen3-30B-A3B's latency and offline, twice; gpt-oss's two; FP8 offline profiled; batch 1
    # profiled in both formats
    assert len(engines) == 9
    for command in engines:
        config = config_from_args(build_parser().parse_args(command[3:]), OFFLINE_DEFAULTS)
        output = Path(command[command.index("--output-json") + 1]).stem
        fp8, mxfp4 = "_fp8" in output, output.endswith("_mxfp4")
        assert config.quantization == ("fp8" if fp8 else "mxfp4" if mxfp4 else None)
        assert config.disable_pdl == output.endswith("_profile")
    [layer] = [c for c in commands if c[4] == "moe"]
    args = build_parser().parse_args(layer[3:])
    assert args.fp8 and args.peer == "vllm"


def test_every_part_asked_of_device_serve_is_one_it_has() -> None:
    cases = (ROOT / "scripts/device_serve.sh").read_text()
    asked = {"stash"}  # each real call's staging
    asked |= {s.removeprefix("PARTS=") for c in dry_run() for s in c if s.startswith("PARTS=")}
    assert asked == {"stash", "install-vllm", "family-vllm"}
    [profiled] = [c for c in dry_run() if "VLLM_TAG=_fp8_profiled" in c]
    assert "--profile-dir" in profiled and "--skip-latency" in profiled
    for part in asked:
        assert re.search(rf"^\s+{re.escape(part)}\)", cases, re.MULTILINE), part
