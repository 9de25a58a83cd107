"""What a model-based proposer costs a step at batch 1 (GPU): one request decodes without
speculation, then with it, in the same process, and each step's times are recorded.

    python3 -m benchmarks.spec_step_cost --model Qwen3-8B --load-format dummy \\
        --speculative-config '{"method": "eagle3", "model": "Qwen3-8B-EAGLE3", \\
        "num_speculative_tokens": 3}' --out spec_step_cost.json

Reported (medians over the decode steps; device times from CUDA events):
- plain_step_ms: a decode step of the target alone (forward and sampling, one token);
- verify_step_ms: a step that verifies k drafts (k + 1 tokens); verify / plain is the target
  of issue 46 (<= 1.15);
- propose_ms: the proposer's wall time after a step's tokens are known until its drafts are
  on the host (its device passes and the one wait), plus `project` (EAGLE-3's fc on the
  step's hidden states, inside the step); propose / verify step is the other target (<= 10 %);
- propose_parts_host_ms: the host time of parts of the proposal, a proposal's mean;
- the wall time per step and per output token of each run.
With dummy weights the head's drafts are random, so tokens per step say nothing of a real head.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kvflow import LLM, SamplingParams


def _record_steps(llm: LLM) -> list[dict[str, float]]:
    """Each collected step's device time, tokens sampled and wall time since the last."""
    runner, steps = llm.runner, []
    collect, last = runner.collect, [time.perf_counter()]

    def timed_collect():  # type: ignore[no-untyped-def]
        output = collect()
        now = time.perf_counter()
        tokens = sum(len(ids) for ids in output.sampled.values())
        wall_ms = (now - last[0]) * 1e3
        steps.append({"device_ms": output.device_ms, "wall_ms": wall_ms, "tokens": tokens})
        last[0] = now
        return output

    runner.collect = timed_collect
    return steps


def _record_proposals(llm: LLM) -> list[float]:
    proposer, times = llm.runner.proposer, []
    if proposer is None or not hasattr(proposer, "propose_step"):
        return times
    propose = proposer.propose_step

    def timed(*args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        drafts = propose(*args)
        times.append((time.perf_counter() - start) * 1e3)
        return drafts

    proposer.propose_step = timed
    return times


# Parts of EAGLE-3's proposal whose host time is recorded (object path, method): where the
# proposal's wall time goes; what they leave is the one wait for the drafts and the rest.
PROPOSAL_PARTS = (
    ("", "_catch_up"),  # the layout, the copy and the replay (eager: the passes) below
    ("catch_up_buffers", "write"),
    ("catch_up_buffers", "copy_to_device"),
    ("catch_up_buffers", "view"),  # eager only
    ("catch_up_graphs", "replay"),
)


def _record_parts(llm: LLM) -> dict[str, float]:
    """Host milliseconds spent in each of PROPOSAL_PARTS, summed over the run."""
    totals: dict[str, float] = {}
    proposer = llm.runner.proposer
    for path, name in PROPOSAL_PARTS if hasattr(proposer, "_catch_up") else ():
        owner = getattr(proposer, path) if path else proposer
        if owner is None:
            continue
        key = f"{path}.{name}" if path else name
        totals[key] = 0.0
        setattr(owner, name, _timed(getattr(owner, name), totals, key))
    return totals


def _timed(method, totals: dict[str, float], key: str):  # type: ignore[no-untyped-def]
    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        result = method(*args, **kwargs)
        totals[key] += (time.perf_counter() - start) * 1e3
        return result

    return timed


def _project_ms(llm: LLM, num_tokens: int) -> float:
    """Device time of the proposer's `project` on a step of `num_tokens` tokens."""
    proposer = llm.runner.proposer
    if proposer is None or not hasattr(proposer, "project") or not torch.cuda.is_available():
        return 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        proposer.project(num_tokens)
    start.record()
    for _ in range(50):
        proposer.project(num_tokens)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 50


def run(args: argparse.Namespace, speculative: str | None) -> dict[str, Any]:
    llm = LLM(
        args.model,
        load_format=args.load_format,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.input_len + args.output_len + 64,
        speculative_config=json.loads(speculative) if speculative else None,
    )
    vocab = llm.runner.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(vocab // 10, vocab // 2, (args.input_len,), generator=generator)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt.tolist()], params)  # the first request meets what the warm-up missed
    steps, proposals, parts = _record_steps(llm), _record_proposals(llm), _record_parts(llm)
    start = time.perf_counter()
    output = llm.generate([prompt.tolist()], params)[0]
    seconds = time.perf_counter() - start
    decode = [step for step in steps[1:] if step["tokens"]]  # the first computes the prompt
    k = llm.runner.num_drafts
    result = {
        "speculative_config": speculative,
        "output_tokens": len(output.token_ids),
        "steps": len(decode) + 1,
        "ms_per_output_token": seconds * 1e3 / len(output.token_ids),
        "step_device_ms": statistics.median(s["device_ms"] for s in decode),
        "step_wall_ms": statistics.median(s["wall_ms"] for s in decode),
        "propose_ms": statistics.median(proposals) if proposals else 0.0,
        "propose_parts_host_ms": {k: v / max(len(proposals), 1) for k, v in parts.items()},
        "project_ms": _project_ms(llm, k + 1) if k else 0.0,
        "acceptance": llm.engine.scheduler.spec_decode.mean_acceptance_length if k else None,
    }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--speculative-config", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    parser.add_argument("--out", type=Path, default=Path("spec_step_cost.json"))
    args = parser.parse_args()
    plain = run(args, None)
    spec = run(args, args.speculative_config)
    propose = spec["propose_ms"] + spec["project_ms"]
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "model": args.model,
        "plain": plain,
        "speculative": spec,
        "verify_over_plain_step": spec["step_device_ms"] / plain["step_device_ms"],
        "propose_over_verify_step": propose / spec["step_device_ms"],
        "propose_over_plain_step": propose / plain["step_device_ms"],
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
