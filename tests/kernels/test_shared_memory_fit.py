"""Kernel launches fit the shared memory of the GPUs people serve on, not only the H100's.

The default tiles are tuned on an H100 (227 KB of shared memory a block). On an L40S, an A10
or an RTX card (99 KB) some of them do not fit, and a launch that does not fit fails before it
runs; `kernels.triton_stages.launch_fitting` retries it with fewer pipeline stages.
`tests/kernels/target_compile.py` compiles the real launchers' launches for those GPUs with
Triton's bundled compiler (no GPU needed) and fails them as such a GPU would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from triton.runtime.errors import OutOfResources

from kernels import triton_stages
from kernels.triton_stages import exact_stages, launch_fitting

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def no_counts_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_stages, "_stages_that_fit", {})


def gpu_that_fits(
    limit_stages: int, launched: list[int], resource: str = "shared memory"
) -> Callable[[int], None]:
    def launch(stages: int) -> None:
        launched.append(stages)
        if stages > limit_stages:
            raise OutOfResources(stages * 48 * 1024, limit_stages * 48 * 1024, resource)

    return launch


def test_a_launch_that_does_not_fit_runs_with_fewer_stages_and_the_count_is_kept() -> None:
    launched: list[int] = []
    launch = gpu_that_fits(2, launched)
    launch_fitting(("kernel", "tiles"), 4, launch)
    assert launched == [4, 3, 2]
    launch_fitting(("kernel", "tiles"), 4, launch)
    assert launched == [4, 3, 2, 2]  # straight to the count that fit
    launch_fitting(("kernel", "other tiles"), 2, launch)
    assert launched == [4, 3, 2, 2, 2]  # other variants keep their own count


def test_a_launch_that_fits_at_no_stage_count_fails() -> None:
    launched: list[int] = []
    with pytest.raises(OutOfResources):
        launch_fitting(("kernel", "huge"), 3, gpu_that_fits(0, launched))
    assert launched == [3, 2, 1]


def test_only_shared_memory_is_retried_and_not_under_exact_stages() -> None:
    launched: list[int] = []
    with pytest.raises(OutOfResources):  # fewer stages free no threads
        launch_fitting(("kernel", "threads"), 3, gpu_that_fits(1, launched, "threads"))
    with exact_stages(), pytest.raises(OutOfResources):  # a sweep's candidate as labelled
        launch_fitting(("kernel", "sweep"), 3, gpu_that_fits(1, launched))
    assert launched == [3, 3]
    launch_fitting(("kernel", "sweep"), 3, gpu_that_fits(1, launched))  # retries again after
    assert launched == [3, 3, 3, 2, 1]


def test_other_errors_are_not_retried() -> None:
    def launch(stages: int) -> None:
        raise ValueError(f"bad input at {stages}")

    with pytest.raises(ValueError, match="at 4"):
        launch_fitting(("kernel", "bad"), 4, launch)


# What each GPU's compile shows at least (tests/kernels/target_compile.py's CHECKS): the checks
# run for it and the kernels they launch. Each GPU compiles in a process of its own, so that the
# four can run side by side (pytest-xdist).
ATTENTION = {"_prefill_kernel", "_decode_partition_kernel"}
BEFORE_HOPPER = (
    {"skinny bf16, 1-16 rows", "int4 dot", "attention bf16 cache"},
    {"_skinny_linear_kernel", "_int4_dot_kernel", *ATTENTION},
)
FP8 = (
    {"fp8 gemv", "int4 dot", "attention bf16 cache", "attention fp8 cache"},
    {"_skinny_linear_kernel", "_fp8_gemv_kernel", "_int4_dot_kernel", *ATTENTION},
)
MOE = {"_gate_up_kernel", "_down_kernel", "_pair_gate_up_kernel", "_token_down_kernel"}
HOPPER = ({"skinny bf16, 17-64 rows (Hopper)", "moe bf16", "moe fp8", "moe mxfp4 gpt-oss"},)
GLUON = ({"int4 wgmma (Gluon)"}, {"_int4_wgmma_kernel"})  # Hopper's alone
INT4_MOE = (
    {"moe int4"},
    {"_int4_gate_up_kernel", "_int4_down_kernel", "_int4_pair_gate_up_kernel",
     "_int4_token_down_kernel"},
)  # fmt: skip
EXPECTED = {
    # A100 (int4 dot: its inline PTX assembles for the oldest GPU too)
    80: (BEFORE_HOPPER[0] | INT4_MOE[0], BEFORE_HOPPER[1] | INT4_MOE[1]),
    86: (BEFORE_HOPPER[0] | {"moe bf16"} | INT4_MOE[0], BEFORE_HOPPER[1] | MOE | INT4_MOE[1]),
    89: (FP8[0] | {"skinny bf16, 1-16 rows", "moe fp8"}, FP8[1] | MOE),  # L40S
    90: (FP8[0] | HOPPER[0] | INT4_MOE[0] | GLUON[0], FP8[1] | MOE | INT4_MOE[1] | GLUON[1]),
}


@pytest.mark.slow
@pytest.mark.parametrize("capability", sorted(EXPECTED))
def test_default_launches_fit_an_a100_an_a10_an_l40s_and_an_h100(capability: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.kernels.target_compile", str(capability)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # a launcher failed on a GPU it runs on
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert {row["capability"] for row in rows} == {capability}
    checks, kernels = EXPECTED[capability]
    assert {row["check"] for row in rows} >= checks
    assert {row["launch"].split()[0] for row in rows} >= kernels
    # The H100 runs every tile as tuned (with PDL, as there): no launch of it needs a retry.
    assert capability != 90 or all(row["fits"] for row in rows)
