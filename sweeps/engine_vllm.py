"""`kvflow bench latency` and `kvflow bench throughput`'s workloads on vLLM, in one engine start:
batch-1 decode (128 prompt tokens, 256 out: the request's time, and its time to the first
token, so that the inter-token latency is (full - first) / 255), then `offline` (256 prompts of
512 tokens, 256 out each, all at once, as `vllm bench throughput --dataset-name random` runs
it). vLLM's log gives the KV cache's size ("GPU KV cache size: N tokens": the requests of
`max_model_len` that fit, times `max_model_len`). For the model-family side-by-sides in
docs/benchmarks.md.

    python sweeps/engine_vllm.py /tmp/gemma-3-12b --out $OUT/gemma_vllm.json
    python sweeps/engine_vllm.py /tmp/Qwen3-30B-A3B --tensor-parallel-size 2 \
        --enable-expert-parallel --out $OUT/moe_ep2_vllm.json

It imports vLLM and nothing of kvflow: run it with vLLM's environment, from a directory
outside the checkout. Random token ids (the folder's tokenizer need not be the model's), no
detokenisation.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any


class Runs:
    """Timed generate calls on one vLLM engine, random token ids of a seeded draw."""

    def __init__(self, llm: Any, seed: int) -> None:
        self.llm = llm
        self.vocab = llm.llm_engine.model_config.get_vocab_size()
        self.rng = random.Random(seed)

    def prompts(self, num: int, length: int) -> list[dict[str, Any]]:
        ids = [[self.rng.randrange(self.vocab) for _ in range(length)] for _ in range(num)]
        return [{"prompt_token_ids": prompt} for prompt in ids]

    def timed(self, num: int, length: int, max_tokens: int) -> tuple[float, int]:
        """Seconds and output tokens of `num` prompts of `length` tokens, all at once."""
        from vllm import SamplingParams

        params = SamplingParams(
            temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=max_tokens, detokenize=False
        )
        batch = self.prompts(num, length)
        start = time.perf_counter()
        outputs = self.llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def latency(runs: Runs, repeats: int) -> dict[str, Any]:
    """Batch 1, 128 in / 256 out: the request's time and its first token's, medians."""
    runs.timed(1, 128, 256)  # warm-up
    full = statistics.median(runs.timed(1, 128, 256)[0] for _ in range(repeats))
    first = statistics.median(runs.timed(1, 128, 1)[0] for _ in range(repeats))
    return {
        "input_len": 128,
        "output_len": 256,
        "request_s_median": round(full, 4),
        "ttft_ms_median": round(1e3 * first, 3),
        "itl_ms": round(1e3 * (full - first) / 255, 3),
    }


def offline(runs: Runs, num_prompts: int) -> dict[str, Any]:
    """`num_prompts` of 512 tokens, 256 out each, all at once."""
    runs.timed(8, 512, 16)  # warm-up for batched prefill
    seconds, out = runs.timed(num_prompts, 512, 256)
    return {
        "num_prompts": num_prompts,
        "input_len": 512,
        "output_len": 256,
        "seconds": round(seconds, 3),
        "output_tok_per_s": round(out / seconds, 1),
    }


def routing(runs: Runs, num_prompts: int, prompt_len: int = 512, steps: int = 32) -> dict[str, Any]:
    """The experts a step chose across the batch: for each decode step (the batch's tokens
    at one position past the prompt) and layer, the number of distinct experts of all the
    sequences' choices, averaged; the same at prompt positions (the prompts' tokens at one
    position, a prefill's mix); and the distinct tokens sampled at a step."""
    import numpy as np
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=steps, detokenize=False
    )
    outputs = runs.llm.generate(runs.prompts(num_prompts, prompt_len), params, use_tqdm=False)
    experts = [o.outputs[0].routed_experts for o in outputs]
    if any(e is None for e in experts):
        return {"error": "no routed_experts in the outputs"}
    # Each token's experts by position (vLLM keeps them by KV slot: the prompt's, then each
    # token fed back), as far as every sequence has them: [seqs, positions, layers, k]
    chosen = np.stack([e[: min(len(e) for e in experts)] for e in experts])
    layers = range(chosen.shape[2])

    def distinct(positions: range) -> float | None:
        counts = [len(np.unique(chosen[:, p, layer])) for p in positions for layer in layers]
        return round(float(np.mean(counts)), 2) if counts else None

    tokens = np.array([o.outputs[0].token_ids for o in outputs])  # [seqs, steps]
    tokens_a_step = [len(np.unique(tokens[:, i])) for i in range(tokens.shape[1])]
    return {
        "num_prompts": num_prompts,
        "chosen_shape": list(chosen.shape),
        "distinct_experts_a_layer_at_decode_steps": distinct(range(prompt_len, chosen.shape[1])),
        "distinct_experts_a_layer_at_prompt_positions": distinct(range(0, prompt_len, 16)),
        "distinct_tokens_a_step": round(float(np.mean(tokens_a_step)), 2),
        "distinct_tokens_in_all": len(np.unique(tokens)),
        "first_tokens_of_4": tokens[:4, :8].tolist(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--enable-expert-parallel", action="store_true")
    parser.add_argument("--quantization", default=None, help="e.g. fp8 (dynamic W8A8)")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--profile-dir",
        type=Path,
        help="after the timed runs, one more `offline` run under vLLM's torch profiler: its "
        "kernels' CUDA time in profiler_out_0.txt here (the trace left out)",
    )
    parser.add_argument("--skip-latency", action="store_true", help="`offline` only")
    parser.add_argument(
        "--routing-report",
        action="store_true",
        help="a mixture of experts: the engine keeps each token's chosen experts "
        "(enable_return_routed_experts), and after the timed runs one more batch of "
        "`offline`'s prompts, 32 tokens out, says how many distinct experts a layer's step "
        "chose and how many distinct tokens the batch sampled",
    )
    parser.add_argument(
        "--dummy-weights",
        choices=("vllm", "normal"),
        default="vllm",
        help="vllm: vLLM's own (uniform in ±1e-3, every parameter from one seed); normal: "
        "drawn as kvflow's, norms at 1 and the rest normal(0, 0.02) (sweeps/vllm_dummy/)",
    )
    args = parser.parse_args()
    if args.dummy_weights == "normal":
        normal_dummy_weights()

    from vllm import LLM

    llm = LLM(
        model=args.model,
        load_format="dummy",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        profiler_config=profiler_config(args.profile_dir),
        enable_return_routed_experts=args.routing_report,
    )
    runs = Runs(llm, args.seed)
    report: dict[str, Any] = {
        "engine": "vllm",
        "model": args.model,
        "tensor_parallel_size": args.tensor_parallel_size,
        "enable_expert_parallel": args.enable_expert_parallel,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "dummy_weights": args.dummy_weights,
        # the timed runs kept every token's experts too (not a figure to set against kvflow's)
        "routed_experts_kept": args.routing_report,
        # what vLLM chose (an AWQ folder runs as awq_marlin where Marlin takes it)
        "quantization_used": llm.llm_engine.model_config.quantization,
    }
    if not args.skip_latency:
        report["latency"] = latency(runs, args.repeats)
        print(json.dumps(report["latency"]), flush=True)
    report["offline"] = offline(runs, args.num_prompts)
    print(json.dumps(report["offline"]), flush=True)
    args.out.write_text(json.dumps(report, indent=1))
    if args.routing_report:
        report["routing"] = routing(runs, args.num_prompts)
        print(json.dumps(report["routing"]), flush=True)
        args.out.write_text(json.dumps(report, indent=1))
    if args.profile_dir is not None:
        llm.start_profile()
        seconds, _ = runs.timed(args.num_prompts, 512, 256)
        llm.stop_profile()
        print(json.dumps({"profiled_offline_seconds": round(seconds, 3)}), flush=True)


def normal_dummy_weights() -> None:
    """sweeps/vllm_dummy/sitecustomize.py in this process and, through PYTHONPATH, in every
    process vLLM starts (its engine core, its workers)."""
    folder = Path(__file__).resolve().parent / "vllm_dummy"
    paths = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{folder}{os.pathsep}{paths}" if paths else str(folder)
    spec = importlib.util.spec_from_file_location("kvflow_vllm_dummy", folder / "sitecustomize.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def profiler_config(directory: Path | None) -> dict[str, Any] | None:
    """vLLM's torch profiler writing its kernel table (self CUDA time) to `directory`; no stacks,
    shapes or memory, which would slow the profiled run."""
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    return {"profiler": "torch", "torch_profiler_dir": str(directory),
            "torch_profiler_with_stack": False, "torch_profiler_record_shapes": False,
            "torch_profiler_use_gzip": False,
            "torch_profiler_dump_cuda_time_total": True}  # fmt: skip


if __name__ == "__main__":
    main()
