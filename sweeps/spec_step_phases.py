"""Where a speculating request's step goes at batch 1: the host's phases and the device's time.

Offline (`kvflow.LLM`), one request of 100 prompt tokens generating --tokens greedily, with and
without n-gram drafts, on a model folder's config with dummy weights. Random weights fall into a
loop under greedy decoding, so n-gram drafts are accepted almost whole: the figures are those of
verifying steps, not of a real workload's mix (sweeps/spec_acceptance.py is that).

    python -m sweeps.spec_step_phases /tmp/smollm2-bf16 --small-k 0 1536 --out phases.json

For each run: wall milliseconds per step, the device's (ModelRunnerOutput.device_ms, from CUDA
events around the step's work), and the wall milliseconds per step spent in each phase of the
loop: schedule, prepare, launch, collect (of which `wait`: the wait for the step's tokens) and
update, and the caller's on_outputs. `--small-k` runs each config at several values of
`kernels.triton_linear.SMALL_K` (0: the skinny linear layer's tiles from before short-K tiles).

It wraps the engine's and runner's methods to time them (PhaseClock): a sweep that reads the
internals on purpose, to be kept in step with them, not an interface. A step counts when it
sampled tokens: a run's first collect is the step that only forgets the run before's request.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kernels import triton_linear
from kvflow import LLM, SamplingParams
from services.executor.runner import sampler

NGRAM = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PHASES = (
    ("schedule", "engine.scheduler", "schedule"),
    ("update", "engine.scheduler", "update"),
    ("prepare", "runner", "prepare"),
    ("launch", "runner", "launch"),
    ("collect", "runner", "collect"),
    ("on_outputs", "worker", "on_outputs"),
)


class PhaseClock:
    """Wall time per named phase, by wrapping the methods that make it up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner: Any, method: str, name: str) -> None:
        original: Callable[..., Any] = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
                self.calls[name] += 1

        setattr(owner, method, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def measure(
    model: str, spec: dict[str, Any] | None, tokens: int, repeats: int, wait: PhaseClock
) -> dict[str, Any]:
    """The median of `repeats` timed generations after one untimed; `wait` times the waits
    for a step's tokens (PendingSample.result, inside collect)."""
    extra = {"speculative_config": spec} if spec else {}
    llm = LLM(
        model, load_format="dummy", max_model_len=4096, kv_cache_memory_bytes=2 << 30, **extra
    )
    clock = PhaseClock()
    for name, path, method in PHASES:
        owner: Any = llm
        for part in path.split("."):
            owner = getattr(owner, part)
        clock.wrap(owner, method, name)
    device_ms: list[float] = []
    collect = llm.runner.collect

    def collect_device_ms() -> Any:
        output = collect()
        if output.sampled:  # not a step that only forgets a finished request
            device_ms.append(output.device_ms)
        return output

    llm.runner.collect = collect_device_ms  # type: ignore[method-assign]
    prompt = list(range(1000, 1100))
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate([prompt], params)
    runs = []
    for _ in range(repeats):
        clock.clear()
        wait.clear()
        device_ms.clear()
        start = time.perf_counter()
        llm.generate([prompt], params)
        wall = time.perf_counter() - start
        steps = len(device_ms)
        runs.append(
            {
                "tok_per_s": tokens / wall,
                "steps": steps,
                "wall_ms_per_step": wall * 1e3 / steps,
                "device_ms_per_step": statistics.fmean(device_ms),
                "phase_ms_per_step": {
                    k: v * 1e3 / steps for k, v in (clock.seconds | wait.seconds).items()
                },
            }
        )
    stats = llm.engine.scheduler.spec_decode
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    middle = sorted(runs, key=lambda run: run["wall_ms_per_step"])[len(runs) // 2]
    return {**middle, "mean_acceptance_length": stats.mean_acceptance_length or None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model folder (its config.json; weights not read)")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 8], help="0: none")
    parser.add_argument("--small-k", type=int, nargs="+", default=[triton_linear.SMALL_K])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    wait = PhaseClock()
    wait.wrap(sampler.PendingSample, "result", "wait")
    results = []
    for small_k in args.small_k:
        triton_linear.SMALL_K = small_k
        for drafts in args.drafts:
            spec = {**NGRAM, "num_speculative_tokens": drafts} if drafts else None
            result = measure(args.model, spec, args.tokens, args.repeats, wait)
            result |= {"small_k": small_k, "drafts": drafts}
            results.append(result)
            print(
                f"SMALL_K {small_k:5} drafts {drafts}: {result['tok_per_s']:7.0f} tok/s, "
                f"{result['wall_ms_per_step']:.3f} ms a step ({result['device_ms_per_step']:.3f}"
                f" on the device), {result['steps']} steps",
                flush=True,
            )
    if args.out:
        args.out.write_text(json.dumps({"model": args.model, "runs": results}, indent=1))


if __name__ == "__main__":
    main()
