"""How busy the GPU is while the engine steps, and where its time goes (torch profiler).

GPU busy = the union of kernel intervals over the span from the first kernel's start to the
last one's end: the fraction of wall time the GPU computes rather than waits for the host.
"""

from __future__ import annotations

import bisect
import time
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from shared.gc_heap import collections_watched, heap_frozen


def idle_gaps(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(start, length) of each stretch inside the span of [start, end) intervals that none
    of them covers, in time order."""
    gaps: list[tuple[float, float]] = []
    if not intervals:
        return gaps
    intervals = sorted(intervals)
    run_end = intervals[0][1]
    for start, end in intervals[1:]:
        if start > run_end:
            gaps.append((run_end, start - run_end))
        run_end = max(run_end, end)
    return gaps


def busy_fraction(intervals: list[tuple[float, float]]) -> float:
    """Covered length of the union of [start, end) intervals over their whole span."""
    if not intervals:
        return 0.0
    span = max(end for _, end in intervals) - min(start for start, _ in intervals)
    idle = sum(length for _, length in idle_gaps(intervals))
    return (span - idle) / span if span > 0 else 0.0


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("profiling measures the GPU: it needs a CUDA device")
    torch.cuda.synchronize()


def _microseconds_by_name(events: list[Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for event in events:
        totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us()
    return totals


def profile_steps(engine: Any, num_steps: int, top: int = 12) -> dict[str, Any]:
    """Profile `num_steps` engine steps; GPU busy fraction and the costliest kernels."""
    _require_cuda()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(num_steps):
            if not engine.has_unfinished():
                break
            engine.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    span_us = max(end for _, end in intervals) - min(start for start, _ in intervals)
    totals = _microseconds_by_name(kernels)
    costliest = sorted(totals.items(), key=lambda item: -item[1])[:top]
    host_ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return {
        "steps": num_steps,
        "gpu_busy_fraction": round(busy_fraction(intervals), 3),
        "span_ms_per_step": round(span_us / 1000 / num_steps, 3),
        "kernel_ms_per_step": round(sum(totals.values()) / 1000 / num_steps, 3),
        "kernels_per_step": round(len(kernels) / num_steps, 1),
        "top_kernels_ms_per_step": {
            name[:90]: round(us / 1000 / num_steps, 4) for name, us in costliest
        },
        "top_host_ops_self_ms_per_step": {
            e.key[:90]: round(e.self_cpu_time_total / 1000 / num_steps, 4) for e in host_ops
        },
    }


def profile_prefill(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    num_steps: int,
    lora_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Admit `prompts` (under the LoRA adapters `lora_ids`, one per prompt) and profile the
    first `num_steps` steps (prompt-heavy ones); abort."""
    ids = _admit(engine, prompts, params, "prefill-profile", lora_ids)
    report = profile_steps(engine, num_steps)
    _abort(engine, ids)
    return report


def _admit(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    prefix: str,
    lora_ids: list[int] | None = None,
) -> list[str]:
    from kvflow import EngineRequest

    ids = [f"{prefix}-{i}" for i in range(len(prompts))]
    loras = lora_ids or [0] * len(prompts)
    for request_id, prompt, sampling, lora_id in zip(ids, prompts, params, loras, strict=True):
        engine.add_request(
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling_params=sampling,
                lora_id=lora_id,
            )
        )
    return ids


def _abort(engine: Any, ids: list[str]) -> None:
    engine.abort(ids)
    while engine.has_unfinished():
        engine.step()


def profile_decode(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    num_steps: int,
    lora_ids: list[int] | None = None,
) -> dict[str, Any]:
    """Admit `prompts` (under `lora_ids`, as profile_prefill), step until all are decoding,
    then profile `num_steps` steps; abort."""
    # Ids of their own per call: those of an earlier call may still retire in the engine.
    ids = _admit(engine, prompts, params, f"profile-{len(prompts)}", lora_ids)
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):  # the last admitted prompts may still be mid-chunk
        engine.step()
    report = profile_steps(engine, num_steps)
    _abort(engine, ids)
    return report


def profile_run(
    engine: Any,
    prompts: list[list[int]],
    params: list[Any],
    lora_ids: list[int] | None = None,
    top: int = 12,
) -> dict[str, Any]:
    """Admit `prompts` and profile every step until they finish: where the GPU waits over a
    whole run (its start and end, and between steps), and what the kernels cost in all.
    Copies and memsets count as GPU activity; a gap's "kernels" are the last to start before
    it and the first after it."""
    _require_cuda()
    # The heap frozen as `LLM.generate` holds it in the timed run, and each collection timed.
    with (
        heap_frozen(),
        collections_watched() as collections,
        profile(activities=[ProfilerActivity.CUDA]) as prof,
    ):
        start = time.perf_counter()
        _admit(engine, prompts, params, "profile-run", lora_ids)
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        torch.cuda.synchronize()
        host_us = (time.perf_counter() - start) * 1e6
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        raise SystemExit("the profiler recorded no GPU activity in the run")
    return {"steps": steps, **_run_timeline(kernels, host_us, top), "gc": collections.report()}


def _run_timeline(kernels: list[Any], host_us: float, top: int) -> dict[str, Any]:
    """A profiled run's GPU time from its kernels (sorted by start): span, idle gaps (the
    longest, with the kernels around each), and the kernels' totals by name."""
    intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    first = intervals[0][0]
    span_us = max(end for _, end in intervals) - first
    gaps = idle_gaps(intervals)
    idle_us = sum(length for _, length in gaps)
    starts = [start for start, _ in intervals]
    totals = _microseconds_by_name(kernels)

    def around(gap_start: float) -> str:
        after = bisect.bisect_left(starts, gap_start)  # the first kernel at or past the gap
        before = kernels[after - 1].name[:40] if after else "-"
        return f"{before} | {kernels[after].name[:40]}" if after < len(kernels) else before

    return {
        "host_ms": round(host_us / 1000, 1),
        "kernel_span_ms": round(span_us / 1000, 1),
        # Admitting the prompts, the first plan, and the last step's outputs: host time with
        # no kernel between the run's start and end.
        "host_outside_span_ms": round((host_us - span_us) / 1000, 1),
        "gpu_busy_fraction": round((span_us - idle_us) / span_us, 4) if span_us else 0.0,
        "idle_ms": round(idle_us / 1000, 1),
        "idle_ms_in_gaps_over_100us": round(sum(g for _, g in gaps if g > 100) / 1000, 1),
        "longest_gaps": [
            {
                "at_ms": round((at - first) / 1000, 1),
                "ms": round(length / 1000, 2),
                "kernels": around(at),
            }
            for at, length in sorted(gaps, key=lambda gap: -gap[1])[:top]
        ],
        "kernel_ms": round(sum(totals.values()) / 1000, 1),
        "top_kernels_ms": {
            name[:90]: round(us / 1000, 1)
            for name, us in sorted(totals.items(), key=lambda item: -item[1])[:top]
        },
    }
