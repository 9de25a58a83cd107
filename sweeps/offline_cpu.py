"""Offline throughput on CPU: kvflow against transformers on the same prompts, in one run.

Random-token prompts (distinct, fixed seed), greedy, ignore EOS, so every system generates
exactly the same number of tokens. Writes a JSON report; prints a short table last.

    python -m sweeps.offline_cpu --num-prompts 32 --input-len 128 --output-len 128
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


def make_workload(
    num: int, input_len: int, output_len: int, mixed: bool, seed: int
) -> tuple[list[list[int]], list[int]]:
    """Prompts and output lengths: fixed, or (mixed) uniform in [len / 4, len]."""
    generator = torch.Generator().manual_seed(seed)

    def lengths(top: int) -> list[int]:
        if not mixed:
            return [top] * num
        return torch.randint(top // 4, top + 1, (num,), generator=generator).tolist()

    prompts = [
        torch.randint(100, 49152, (n,), generator=generator).tolist() for n in lengths(input_len)
    ]
    return prompts, lengths(output_len)


def run_kvflow(prompts: list[list[int]], output_lens: list[int]) -> dict:
    llm = LLM(dtype="float32", device="cpu")
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert [len(r.token_ids) for r in results] == output_lens
    return _report("kvflow", elapsed, prompts, [r.token_ids for r in results])


def run_transformers(prompts: list[list[int]], output_lens: list[int], batch_size: int) -> dict:
    """Static batches, left-padded; each batch runs until its longest request is done."""
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model.generate(torch.tensor(prompts[:1]), max_new_tokens=4, do_sample=False)  # warm-up
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, wanted = prompts[i : i + batch_size], output_lens[i : i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            tokens = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(wanted),
                min_new_tokens=max(wanted),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        # Tokens past a request's own length are waste that static batching pays for.
        rows = tokens.tolist()
        outputs.extend(row[width : width + n] for row, n in zip(rows, wanted, strict=True))
    elapsed = time.perf_counter() - start
    name = f"transformers generate (static batch {batch_size})"
    return _report(name, elapsed, prompts, outputs)


def _report(name: str, elapsed: float, prompts: list[list[int]], outputs: list[list[int]]) -> dict:
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
    parser.add_argument(
        "--mixed", action="store_true", help="Lengths uniform in [len/4, len] instead of fixed."
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        default=f"docs/results/{time.strftime('%Y-%m-%d')}-cpu-offline/offline_cpu.json",
        help="JSON path (default: a folder of today's date under docs/results/)",
    )
    args = parser.parse_args()

    prompts, output_lens = make_workload(
        args.num_prompts, args.input_len, args.output_len, args.mixed, args.seed
    )
    runs = [run_kvflow(prompts, output_lens)]
    runs += [run_transformers(prompts, output_lens, b) for b in args.hf_batch_sizes]
    # Greedy on the same weights: agreement is a sanity check, not a requirement (padding
    # changes fp32 rounding, which may flip near-ties).
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
