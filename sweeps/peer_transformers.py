"""Hugging Face transformers as a peer to kvflow, on the same GPU and the same prompts.

The model is built from a kvflow preset (shared/presets/<name>.json) or any config.json path,
with random weights (normal(0, 0.02), the transformers default init, run on the target device so
an 8B model initialises in seconds). Prompts are the random-token prompts kvflow's benchmarks use
(`random_prompts`); decoding is greedy and never stops early (the config's eos_token_id is dropped,
and every output is checked to be exactly --output-len tokens long). Three measurements:

  static      `model.generate` over all prompts in fixed batches of --static-batch-size
              (left padding + attention mask when lengths differ), output tokens / second.
  continuous  transformers' continuous batching, `model.generate_batch`, with paged SDPA
              attention (no flash auto-switch; prefix sharing off, as in kvflow's runs). A short
              warm-up call creates the manager (KV cache, CUDA graphs) and keeps it; the timed
              call reuses it, so setup is excluded, as kvflow's engine construction is.
              Output tokens / second. A failure is recorded in the JSON, not raised.
  latency     batch-1 inter-token latency: (time of generating 1+N tokens - time of 1 token) / N
              for one 128-token prompt, in ms.

Every timed region is bracketed by device synchronisation; each mode gets one warm-up call.

    python -m sweeps.peer_transformers --model Llama-3.1-8B
    python -m sweeps.peer_transformers --model /tmp/tiny.json --device cpu --dtype float32 \\
        --num-prompts 4 --input-len 16 --output-len 8 --static-batch-size 2

Writes JSON to --out (default $OUT/peer_transformers.json, or ./peer_transformers.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedModel

PRESETS_DIR = Path(__file__).resolve().parent.parent / "shared" / "presets"
MODES = ("latency", "static", "continuous")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def random_prompts(num: int, input_len: int, vocab: int, seed: int) -> list[list[int]]:
    """The random-token prompts kvflow's benchmarks use for the same (num, input_len, seed)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (num, input_len), generator=generator).tolist()


def config_path(model: str) -> Path:
    """A preset name (shared/presets/<name>.json) or a path to a config JSON."""
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    preset = PRESETS_DIR / f"{model}.json"
    if preset.is_file():
        return preset
    names = ", ".join(sorted(p.stem for p in PRESETS_DIR.glob("*.json")))
    raise SystemExit(f"--model {model!r} is neither a config JSON nor a preset ({names})")


def load_config(path: Path) -> transformers.PretrainedConfig:
    """The transformers config of a config JSON, without EOS so generation never stops early."""
    raw = json.loads(path.read_text())
    raw["eos_token_id"] = None
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def build_model(
    config: transformers.PretrainedConfig, device: str, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    """Random weights, allocated and initialised directly on `device` (fast on a GPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def greedy_config(max_new_tokens: int) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(device: str, fn: Callable[[], Any]) -> tuple[float, Any]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def left_pad(batch: list[list[int]], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and attention mask, padded on the left to the longest prompt."""
    width = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


def generate_static(model: PreTrainedModel, batch: list[list[int]], new_tokens: int) -> int:
    """One `generate` call; returns the number of new tokens (checked: new_tokens per prompt)."""
    ids, mask = left_pad(batch, str(model.device))
    config = greedy_config(new_tokens)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    got = out.shape[1] - ids.shape[1]
    if got != new_tokens:
        raise RuntimeError(f"generate returned {got} new tokens per prompt, wanted {new_tokens}")
    return got * len(batch)


def run_static(
    model: PreTrainedModel, prompts: list[list[int]], output_len: int, batch_size: int
) -> dict[str, Any]:
    device = str(model.device)
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    generate_static(model, batches[0], min(4, output_len))  # warm-up
    seconds, tokens = timed(
        device, lambda: sum(generate_static(model, b, output_len) for b in batches)
    )
    return {
        "batch_size": batch_size,
        "num_batches": len(batches),
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / seconds, 1),
    }


def run_latency(
    model: PreTrainedModel, vocab: int, seed: int, prompt_len: int, tokens: int
) -> dict[str, Any]:
    device = str(model.device)
    prompt = random_prompts(1, prompt_len, vocab, seed)
    generate_static(model, prompt, min(8, tokens + 1))  # warm-up
    long_s, _ = timed(device, lambda: generate_static(model, prompt, tokens + 1))
    short_s, _ = timed(device, lambda: generate_static(model, prompt, 1))
    return {
        "prompt_len": prompt_len,
        "decode_tokens": tokens,
        "long_s": round(long_s, 4),
        "short_s": round(short_s, 4),
        "itl_ms": round(1000 * (long_s - short_s) / tokens, 3),
    }


def cb_attn_implementation() -> str:
    """transformers <= 5.17 registers 'paged|sdpa'; later versions page plain 'sdpa' themselves."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return "paged|sdpa" if "paged|sdpa" in ALL_ATTENTION_FUNCTIONS else "sdpa"


def cb_config(
    num_requests: int, num_blocks: int | None = None, max_batch_tokens: int | None = None
) -> Any:
    """A ContinuousBatchingConfig valid on transformers 5.17 and 5.23 (fields differ).

    num_blocks / max_batch_tokens left None are sized by transformers from free device memory.
    """
    from transformers import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    wanted = {
        "max_requests_per_batch": min(num_requests, 1024),  # what generate_batch's hints give
        "max_blocks_per_request": 0,  # the block-table decode path needs flash attention
        "allow_block_sharing": False,  # no prefix caching: kvflow runs with it off
        "auto_switch_to_flash": False,  # 5.23+: keep SDPA even if flash-attn is installed
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
    }
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def cpu_cache_size(num_requests: int, max_len: int) -> tuple[int, int]:
    """(num_blocks, max_batch_tokens) for a CPU smoke run: 5.17 would size the cache from RAM."""
    page = 256  # the default page (5.23) / block (5.17) size
    return num_requests * (math.ceil(max_len / page) + 1), 1024


def cb_summary(model: PreTrainedModel) -> dict[str, Any]:
    """The resolved settings of the cached continuous batching manager."""
    manager = getattr(model, "_cached_continuous_batching_manager", None)
    config = getattr(manager, "continuous_batching_config", None)
    keys = ("page_size", "block_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch")
    keys += ("use_cuda_graph", "use_async_batching")
    summary = {k: getattr(config, k) for k in keys if getattr(config, k, None) is not None}
    return {k: list(v) if isinstance(v, tuple) else v for k, v in summary.items()}


def generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], new_tokens: int, cb: Any
) -> int:
    """One `generate_batch` call on the kept manager; returns the number of new tokens."""
    outputs = model.generate_batch(
        inputs=prompts,
        generation_config=greedy_config(new_tokens),
        continuous_batching_config=cb,
        persistent_manager=True,
        max_new_tokens=new_tokens,
    )
    lengths = [len(o.generated_tokens) for o in outputs.values() if o.error is None]
    errors = [str(o.error) for o in outputs.values() if o.error is not None]
    if len(lengths) != len(prompts) or any(n != new_tokens for n in lengths):
        raise RuntimeError(
            f"generate_batch finished {len(lengths)}/{len(prompts)} prompts "
            f"(lengths {sorted(set(lengths))}, wanted {new_tokens}); errors: {errors[:3]}"
        )
    return sum(lengths)


def run_continuous(
    model: PreTrainedModel,
    prompts: list[list[int]],
    output_len: int,
    vocab: int,
    seed: int,
    sizes: tuple[int | None, int | None] = (None, None),
) -> dict[str, Any]:
    """`sizes`: (num_blocks, max_batch_tokens) of the paged cache; None means auto."""
    device = str(model.device)
    attn = cb_attn_implementation()
    if device == "cpu" and sizes == (None, None):
        sizes = cpu_cache_size(len(prompts), len(prompts[0]) + output_len)
    cb = cb_config(len(prompts), *sizes)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # auto-sizing counts memory reserved by earlier modes as used
    model.set_attn_implementation(attn)
    try:
        warm = random_prompts(min(8, len(prompts)), len(prompts[0]), vocab, seed + 1)
        setup_s, _ = timed(device, lambda: generate_batch(model, warm, min(8, output_len), cb))
        settings = cb_summary(model)
        seconds, tokens = timed(device, lambda: generate_batch(model, prompts, output_len, cb))
    finally:
        model.destroy_cached_continuous_batching_manager()
        model.set_attn_implementation("sdpa")
    return {
        "attn_implementation": attn,
        "settings": settings,
        "warmup_s": round(setup_s, 3),
        "seconds": round(seconds, 3),
        "output_tokens": tokens,
        "output_tok_per_s": round(tokens / seconds, 1),
    }


def guarded(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one mode; on failure print the traceback and return the error instead."""
    try:
        return fn()
    except Exception as exc:
        traceback.print_exc()
        print(f"[{name}] FAILED: {exc!r}", file=sys.stderr)
        return {"error": f"{type(exc).__name__}: {exc}"}


def summary_line(name: str, result: dict[str, Any]) -> str:
    if "error" in result:
        return f"[{name}] error: {result['error'][:200]}"
    if name == "latency":
        return f"[latency] batch-1 ITL {result['itl_ms']:.2f} ms"
    return f"[{name}] {result['output_tok_per_s']:.1f} output tok/s ({result['seconds']:.2f} s)"


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def default_out() -> Path:
    return Path(os.environ.get("OUT", ".")) / "peer_transformers.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="Llama-3.1-8B", help="preset name or config JSON")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--static-batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (kvflow bench: --seed)")
    parser.add_argument("--latency-prompt-len", type=int, default=128)
    parser.add_argument("--latency-tokens", type=int, default=128, help="N in (1+N) - 1")
    parser.add_argument("--skip", nargs="*", default=[], choices=MODES, help="modes to skip")
    parser.add_argument(
        "--cb-num-blocks", type=int, default=None, help="continuous: KV blocks (default: auto)"
    )
    parser.add_argument(
        "--cb-max-batch-tokens", type=int, default=None, help="continuous: (default: auto)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--out", type=Path, default=None, help="JSON path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = config_path(args.model)
    config = load_config(path)
    load_s, model = timed(
        args.device, lambda: build_model(config, args.device, DTYPES[args.dtype], args.seed)
    )
    vocab = config.vocab_size
    prompts = random_prompts(args.num_prompts, args.input_len, vocab, args.seed)
    cb_sizes = (args.cb_num_blocks, args.cb_max_batch_tokens)
    print(f"[load] {path.name} on {device_name(args.device)} in {load_s:.1f} s")
    jobs: dict[str, Callable[[], dict[str, Any]]] = {
        "latency": lambda: run_latency(
            model, vocab, args.seed + 2, args.latency_prompt_len, args.latency_tokens
        ),
        "static": lambda: run_static(model, prompts, args.output_len, args.static_batch_size),
        "continuous": lambda: run_continuous(
            model, prompts, args.output_len, vocab, args.seed, cb_sizes
        ),
    }
    results: dict[str, Any] = {}
    for name, job in jobs.items():
        if name in args.skip:
            continue
        results[name] = guarded(name, job)
        print(summary_line(name, results[name]), flush=True)
    report = {
        "engine": "transformers",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "model": args.model,
        "config": str(path),
        "device": device_name(args.device),
        "dtype": args.dtype,
        "parameters": sum(p.numel() for p in model.parameters()),
        "load_s": round(load_s, 2),
        "workload": {
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "seed": args.seed,
            "vocab": vocab,
        },
        **results,
    }
    out = args.out or default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    failed = [n for n in ("latency", "static") if "error" in results.get(n, {})]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
