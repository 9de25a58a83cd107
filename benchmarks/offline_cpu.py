"""Offline throughput on CPU: kvflow against transformers on the same prompts, in one run.

Random-token prompts (distinct, fixed seed), greedy, ignore EOS, so every system generates
exactly the same number of tokens. Writes a JSON report; prints a short table last.

    python benchmarks/offline_cpu.py --num-prompts 32 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch
import transformers

from kvflow import LLM, SamplingParams
from shared.model_config import embedded_model_path


def make_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (num, length), generator=generator).tolist()


def run_kvflow(prompts: list[list[int]], output_len: int) -> dict:
    llm = LLM(dtype="float32", device="cpu")
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(r.token_ids) == output_len for r in results)
    return _report("kvflow", elapsed, prompts, output_len, [r.token_ids for r in results])


def run_transformers(prompts: list[list[int]], output_len: int, batch_size: int) -> dict:
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=4, do_sample=False)  # warm-up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = torch.tensor(prompts[i : i + batch_size])  # equal lengths: no padding needed
        with torch.no_grad():
            tokens = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        outputs.extend(tokens[:, batch.shape[1] :].tolist())
    elapsed = time.perf_counter() - start
    return _report(
        f"transformers generate (static batch {batch_size})", elapsed, prompts, output_len, outputs
    )


def _report(
    name: str, elapsed: float, prompts: list[list[int]], output_len: int, outputs: list[list[int]]
) -> dict:
    num_out = sum(len(o) for o in outputs)
    num_in = sum(len(p) for p in prompts)
    return {
        "system": name,
        "seconds": round(elapsed, 3),
        "output_tok_per_s": round(num_out / elapsed, 1),
        "total_tok_per_s": round((num_in + num_out) / elapsed, 1),
        "outputs": outputs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="benchmarks/results/offline_cpu.json")
    args = parser.parse_args()

    prompts = make_prompts(args.num_prompts, args.input_len, 49152, args.seed)
    runs = [run_kvflow(prompts, args.output_len)]
    runs += [run_transformers(prompts, args.output_len, b) for b in args.hf_batch_sizes]
    # Greedy on the same weights: agreement is a sanity check, not a requirement (fp32
    # padding-free batches may still differ where two logits nearly tie).
    for run in runs[1:]:
        same = sum(a == b for a, b in zip(runs[0]["outputs"], run["outputs"], strict=True))
        run["identical_outputs_to_kvflow"] = f"{same}/{len(prompts)}"
    for run in runs:
        del run["outputs"]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    report = {
        "benchmark": "offline_cpu",
        "model": "SmolLM2-135M-Instruct (Q4_1 GGUF, float32)",
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        **vars(args),
        "runs": runs,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"\n{'system':45} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12}")
    for run in runs:
        print(
            f"{run['system']:45} {run['seconds']:8.1f} {run['output_tok_per_s']:10.1f} "
            f"{run['total_tok_per_s']:12.1f}"
        )


if __name__ == "__main__":
    main()
