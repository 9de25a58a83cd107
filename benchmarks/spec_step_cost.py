"""What a model-based proposer costs a step at batch 1 (GPU): one request decodes without
speculation, then with it, in the same process, and each step's times are recorded.

    python3 -m benchmarks.spec_step_cost --model Qwen3-8B --load-format dummy \\
        --speculative-config '{"method": "eagle3", "model": "Qwen3-8B-EAGLE3", \\
        "num_speculative_tokens": 3}' --out spec_step_cost.json

Reported (medians over the decode steps; device times from CUDA events):
- plain_step_ms: a decode step of the target alone (forward and sampling, one token);
- verify_step_ms: a step that verifies k drafts (k + 1 tokens); verify / plain is the target
  of issue 46 (<= 1.15);
- propose_device_ms: the device span of the proposer's work after a step (EAGLE-3: its fc of
  the step's hidden states, the catch-up and the draft passes, the drafts' copy; a draft
  model: its forward pass over the step, its k passes, the copy), which the
  next step's layout waits for; propose / verify step is the other target (<= 10 %);
- propose_queue_host_ms: the host time of queueing that work (beside the step's device work);
- propose_take_ms: the host's wall time taking the drafts once the step's tokens are in;
- the wall time per step and per output token of each run.
With dummy weights the drafts are random, so tokens per step say nothing of a real proposer
(a draft model: `"model": "Qwen3-0.6B"`, a preset, drafts for Qwen3-8B's shape).
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


def _record_proposals(llm: LLM) -> dict[str, list[float]]:
    """Per step of a proposer that drafts on the device after each step (a draft model,
    EAGLE-3): the device span of its work (`after_step`, from before its first kernel to after
    its drafts' copy: CUDA events, off the CPU the wall time), the host time of queueing it,
    and the wall time the host then spends taking the drafts once the step's tokens are in
    (`take_drafts`, which waits for the copy)."""
    proposer = llm.runner.proposer
    times: dict[str, list[float]] = {"device": [], "queue_host": [], "take": []}
    if proposer is None or not hasattr(proposer, "after_step"):
        return times
    after_step, take_drafts, spans = proposer.after_step, proposer.take_drafts, []

    def timed_after_step(*args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        began = _mark()
        proposal = after_step(*args)
        spans.append((began, _mark()))
        times["queue_host"].append((time.perf_counter() - start) * 1e3)
        return proposal

    def timed_take_drafts(*args):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        drafts = take_drafts(*args)
        times["take"].append((time.perf_counter() - start) * 1e3)
        times["device"].append(_milliseconds(*spans.pop(0)))  # the step's, long since done
        return drafts

    proposer.after_step, proposer.take_drafts = timed_after_step, timed_take_drafts
    return times


def _mark() -> Any:
    """A point on the device's stream (a recorded timing event), or the clock off CUDA."""
    if not torch.cuda.is_available():
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _milliseconds(start: Any, end: Any) -> float:
    if isinstance(start, float):
        return (end - start) * 1e3
    end.synchronize()
    return float(start.elapsed_time(end))


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
    steps, proposals = _record_steps(llm), _record_proposals(llm)
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
        **{
            f"propose_{name}_ms": statistics.median(values) if values else 0.0
            for name, values in proposals.items()
        },
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
    propose = spec["propose_device_ms"]
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
