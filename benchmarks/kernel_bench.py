"""GPU microbenchmarks: the ceilings (copy bandwidth, bf16 matmul rate) and decode attention.

Timed with CUDA events through `triton.testing.do_bench` (median of many runs, after warm-up),
on random data (zeros can run faster than real data), rotating between inputs larger than L2
so that repeats measure memory, not cache.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

COPY_BYTES = 2 << 30  # per buffer; 2 GiB is far beyond any L2


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA device")


def median_ms(fn: Any) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=50, rep=300, return_mode="median"))


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy: (bytes read + bytes written) / time, in GB/s."""
    numel = COPY_BYTES // 2
    sources = [torch.randn(numel, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    target = torch.empty_like(sources[0])
    turn = [0]

    def copy() -> None:
        turn[0] ^= 1
        target.copy_(sources[turn[0]])

    return 2 * COPY_BYTES / (median_ms(copy) * 1e-3) / 1e9


def matmul_tflops(size: int = 8192) -> float:
    a = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    return 2 * size**3 / (median_ms(lambda: a @ b) * 1e-3) / 1e12


def floors_bench() -> dict[str, Any]:
    _require_cuda()
    return {
        "benchmark": "floors",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gb_per_s": round(copy_bandwidth_gbs(), 1),
        "bf16_matmul_tflops": round(matmul_tflops(), 1),
    }


def decode_case(
    batch: int,
    context: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Random bf16 queries and a cache (bf16 or e4m3) whose blocks are shuffled, as after real
    traffic. The bytes counted are the cache's own: an FP8 cache reads half as many."""
    block_size = 16
    blocks_per_req = -(-context // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    value_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    query = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * kv_dtype.itemsize
    io_bytes = 2 * query.numel() * 2  # the query read and the output written
    return (query, key_cache, value_cache, tables, seq_lens), kv_bytes + io_bytes


def attention_bench(args: argparse.Namespace) -> dict[str, Any]:
    _require_cuda()
    from kernels.attention import paged_attention_reference
    from kernels.triton_decode_attention import paged_decode_attention

    copy_gbs = copy_bandwidth_gbs()
    scale = args.head_dim**-0.5
    kv_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else torch.bfloat16
    rows = []
    for batch in args.batch_sizes:
        for context in args.context_lens:
            if batch * context * args.num_kv_heads * args.head_dim * 4 > 24 << 30:
                continue  # over 24 GiB of K/V: skip rather than run out of memory
            inputs, num_bytes = decode_case(
                batch, context, args.num_heads, args.num_kv_heads, args.head_dim, kv_dtype
            )
            ms = median_ms(functools.partial(paged_decode_attention, *inputs, scale))
            row = {
                "batch_size": batch,
                "context_len": context,
                "us": round(1000 * ms, 1),
                "gb_per_s": round(num_bytes / (ms * 1e-3) / 1e9, 1),
                "fraction_of_copy": round(num_bytes / (ms * 1e-3) / 1e9 / copy_gbs, 3),
            }
            if batch * context <= 64 * 4096:  # the reference's gathers are large
                qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
                reference = functools.partial(
                    paged_attention_reference, *inputs, qsl, 1, context, scale
                )
                row["reference_us"] = round(1000 * median_ms(reference), 1)
            rows.append(row)
            del inputs
            torch.cuda.empty_cache()
    return {
        "benchmark": "attention",
        "device": torch.cuda.get_device_name(),
        "copy_gb_per_s": round(copy_gbs, 1),
        "shape": {
            "num_heads": args.num_heads,
            "num_kv_heads": args.num_kv_heads,
            "head_dim": args.head_dim,
            "dtype": "bfloat16",
            "kv_cache_dtype": str(kv_dtype).removeprefix("torch."),
            "block_size": 16,
        },
        "results": rows,
    }
