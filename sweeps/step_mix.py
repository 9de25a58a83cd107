"""What a prefill costs the decodes it joins: engine steps on the GPU, no HTTP, no processes.

Serving at a moderate rate, most steps decode a running batch and some also carry a new
request's prompt. This measures, in-process through `EngineCore`:
- the first request's time to first token on a fresh engine (compiles included), then warm;
- a decode step of `--batch` running requests (CUDA graph), with the torch profiler;
- steps that each add one `--prompt-len` prompt to that batch (a mixed-step CUDA graph up to
  512 tokens, eager above): the first few timed apart, then profiled the same way.

    python -m sweeps.step_mix Qwen3-8B --load-format dummy --batch 32 --prompt-len 200

`--quantization` and `--kv-cache-dtype` as the engine's (e.g. `--quantization fp8 --batch 256`:
where an FP8 step of `offline`'s batch spends its time, beside the same run in bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.engine_bench import random_prompts
from benchmarks.step_profile import profile_steps
from kvflow import LLM, EngineCore, EngineRequest, SamplingParams


def first_token_ms(engine: EngineCore, prompt: list[int], request_id: str) -> float:
    """Add a one-token request to an idle engine, step until it ends: engine-only TTFT."""
    start = time.perf_counter()
    engine.add_request(
        EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
        )
    )
    while engine.has_unfinished():
        engine.step()
    while engine.step():  # drain the plan in flight
        pass
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quantization", help="as the engine's (fp8, awq, ...)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--output-json", type=Path)
    args = parser.parse_args()

    llm = LLM(
        args.model,
        load_format=args.load_format,
        max_model_len=args.max_model_len,
        seed=0,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    engine = llm.engine
    vocab = llm.runner.model_config.vocab_size
    prompts = iter(random_prompts(1000, [args.prompt_len] * 1000, vocab, seed=1))
    report: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
    }
    report["first_request_ttft_ms"] = first_token_ms(engine, next(prompts), "cold")
    warm = [first_token_ms(engine, next(prompts), f"warm-{i}") for i in range(10)]
    report["warm_ttft_ms_median"] = statistics.median(warm)

    decoders = [f"decode-{i}" for i in range(args.batch)]
    for request_id in decoders:
        engine.add_request(
            EngineRequest(
                request_id=request_id,
                prompt_token_ids=next(prompts),
                sampling_params=SamplingParams(temperature=0.0, max_tokens=3000, ignore_eos=True),
            )
        )
    for _ in range(20):  # every prompt in, steady decoding
        engine.step()
    report["decode_only"] = profile_steps(engine, args.steps)

    class AddOnePerStep:
        """The engine, with one new one-token request joining before every step."""

        def __init__(self) -> None:
            self.count = 0

        def has_unfinished(self) -> bool:
            return engine.has_unfinished()

        def step(self) -> None:
            engine.add_request(
                EngineRequest(
                    request_id=f"mix-{self.count}",
                    prompt_token_ids=next(prompts),
                    sampling_params=SamplingParams(temperature=0.0, max_tokens=1),
                )
            )
            self.count += 1
            engine.step()

    mixing = AddOnePerStep()
    start = time.perf_counter()
    for _ in range(args.steps):  # first: compiles of the mixed shapes, timed apart
        mixing.step()
    torch.cuda.synchronize()
    report["first_mixed_steps_ms_per_step"] = (time.perf_counter() - start) * 1000 / args.steps
    report["decode_plus_one_prefill"] = profile_steps(mixing, args.steps)
    engine.abort(decoders)
    print(json.dumps(report, indent=2))
    if args.output_json is not None:
        args.output_json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
