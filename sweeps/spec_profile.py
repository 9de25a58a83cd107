"""Where a speculating request's step goes at batch 1 (GPU): torch profiler over a short
greedy run, the costliest ops by host and by device time, and the proposer's share.

    python3 sweeps/spec_profile.py --model Qwen3-8B \\
        --speculative-config '{"method": "eagle3", "model": "Qwen3-8B-EAGLE3", \\
        "num_speculative_tokens": 3}'
"""

from __future__ import annotations

import argparse
import json

from torch.profiler import ProfilerActivity, profile, record_function

from kvflow import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen3-8B")
    parser.add_argument("--speculative-config", required=True)
    parser.add_argument("--output-len", type=int, default=48)
    args = parser.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        gpu_memory_utilization=0.4,
        max_model_len=1024,
        speculative_config=json.loads(args.speculative_config),
    )
    prompt = list(range(1000, 1128))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([prompt], params)
    proposer = llm.runner.proposer
    after_step = proposer.after_step

    def traced(*a):  # type: ignore[no-untyped-def]
        with record_function("after_step"):
            return after_step(*a)

    proposer.after_step = traced
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], params)
    table = prof.key_averages()
    print(table.table(sort_by="self_cpu_time_total", row_limit=30))
    print(table.table(sort_by="self_cuda_time_total", row_limit=20))


if __name__ == "__main__":
    main()
