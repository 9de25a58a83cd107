"""Prefill attention: the paged Triton kernel's launch configs against its defaults and against
PyTorch's fused attention (FlashAttention-2 and cuDNN backends of scaled_dot_product_attention).

For each case of CASES at Llama-3.1-8B's and Qwen3-8B's attention shape (32 query heads, 8 KV
heads, head_dim 128, bf16, block_size 16), times `paged_prefill_attention` with `default_tiles`
and with every `PrefillTiles` of CANDIDATES, and, where the queries are a whole prompt, PyTorch's
two fused backends on contiguous K/V with the KV heads repeated (outside the timing). Reports
milliseconds per call and TFLOP/s of causal attention (each query against the keys it sees: two
products of head_dim multiply-adds per key and head). Every config is first checked against the
defaults' output and skipped, with the error, if it fails, does not compile or runs out of
shared memory.

    python -m sweeps.prefill_attention_sweep --out $OUT/prefill_attention_sweep.json

Needs a CUDA GPU and ~4 GB of its memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import torch

from benchmarks.kernel_bench import median_ms
from kernels.triton_prefill_attention import (
    PrefillTiles,
    default_tiles,
    paged_prefill_attention,
)
from kernels.triton_stages import exact_stages

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
GROUP = NUM_HEADS // NUM_KV_HEADS


@dataclasses.dataclass(frozen=True)
class Case:
    num_reqs: int
    query_len: int  # new tokens per request
    context_len: int  # tokens per request including the new ones (> query_len: a later chunk)

    @property
    def name(self) -> str:
        chunk = f" over {self.context_len}" if self.context_len > self.query_len else ""
        return f"{self.num_reqs} x {self.query_len}{chunk}"

    @property
    def flops(self) -> float:
        """Causal: query i of a request sees context_len - query_len + i + 1 keys."""
        first = self.context_len - self.query_len + 1
        keys = self.query_len * (first + self.context_len) / 2  # per request and head
        return 4.0 * HEAD_DIM * NUM_HEADS * self.num_reqs * keys


CASES = [
    Case(16, 512, 512),  # an `offline` prefill step of 8192 tokens
    Case(4, 2048, 2048),
    Case(1, 8192, 8192),
    Case(1, 32768, 32768),
    Case(1, 2048, 32768),  # the last 2048-token chunk of a 32k prompt (chunked prefill)
]
CANDIDATES = [
    PrefillTiles(block_m, block_n, warps, stages)
    for block_m in (64, 128)
    for block_n in (64, 128)
    for warps in (4, 8)
    for stages in (2, 3, 4)
]
ATOL = 2e-2


def make_inputs(case: Case) -> dict[str, Any]:
    """Random queries and a shuffled paged cache holding each request's context."""
    blocks_per_req = -(-case.context_len // BLOCK_SIZE)
    num_blocks = case.num_reqs * blocks_per_req
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    value_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    tables = torch.randperm(num_blocks, device="cuda", dtype=torch.int32)
    tables = tables.view(case.num_reqs, blocks_per_req)
    tokens = case.num_reqs * case.query_len
    query = torch.randn(tokens, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((case.num_reqs,), case.context_len, device="cuda", dtype=torch.int32)
    starts = torch.arange(case.num_reqs + 1, device="cuda", dtype=torch.int32) * case.query_len
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables,
        "seq_lens": seq_lens,
        "query_start_loc": starts,
        "max_query_len": case.query_len,
        "max_seq_len": case.context_len,
        "scale": HEAD_DIM**-0.5,
    }


def contiguous_kv(case: Case, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, H, S, D] keys and values gathered from the cache, KV heads repeated per query head."""
    tables = inputs["block_tables"].long()
    out = []
    for cache in (inputs["key_cache"], inputs["value_cache"]):
        per_req = cache[tables].flatten(1, 2)[:, : case.context_len]  # [R, S, KV, D]
        out.append(per_req.repeat_interleave(GROUP, dim=2).transpose(1, 2).contiguous())
    return out[0], out[1]


def sdpa_call(case: Case, inputs: dict[str, Any], backend: Any) -> Any:
    """PyTorch's fused attention on the same prompts (whole prompts only: is_causal aligns the
    mask to the top left, which is right only when the queries are the whole context)."""
    from torch.nn.attention import sdpa_kernel

    key, value = contiguous_kv(case, inputs)
    # [R, H, S, D] views of the token-major queries, as an engine passes them: no copy, and
    # the output comes back in the same layout, so only the attention itself is timed.
    query = inputs["query"].view(case.num_reqs, case.query_len, NUM_HEADS, HEAD_DIM)
    query = query.transpose(1, 2)

    def call() -> torch.Tensor:
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(
                query, key, value, is_causal=True
            )

    return call


def time_one(case: Case, label: str, call: Any, expected: torch.Tensor) -> dict[str, Any]:
    out = call().float()
    if out.dim() == 4:  # PyTorch's [R, H, S, D]: compared token-major, outside the timing
        out = out.transpose(1, 2).reshape(expected.shape)
    torch.testing.assert_close(out, expected, atol=ATOL, rtol=ATOL)
    ms = median_ms(call)
    return {
        "case": case.name,
        "impl": label,
        "ms": round(ms, 4),
        "tflops": round(case.flops / (ms * 1e-3) / 1e12, 1),
    }


def sweep_case(case: Case, candidates: list[PrefillTiles]) -> tuple[list[dict], list[dict]]:
    torch.manual_seed(case.num_reqs * 100_003 + case.query_len)
    inputs = make_inputs(case)
    default = default_tiles(HEAD_DIM, GROUP, case.query_len)
    expected = paged_prefill_attention(**inputs, tiles=default).float()
    calls = [("default", default)] + [(label(t), t) for t in candidates if t != default]
    rows, skipped = [], []
    for name, tiles in calls:
        call = functools.partial(paged_prefill_attention, **inputs, tiles=tiles)
        try:
            row = time_one(case, name, call, expected)
        except Exception as error:  # compile failure, shared memory, mismatch: reported
            reason = "; ".join(str(error).splitlines()[:2])[:200]
            skipped.append({"case": case.name, "impl": name, "error": reason})
            continue
        rows.append({**row, "tiles": dataclasses.asdict(tiles), "is_default": name == "default"})
    if case.context_len == case.query_len:
        from torch.nn.attention import SDPBackend

        for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                              ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):  # fmt: skip
            try:
                rows.append(time_one(case, name, sdpa_call(case, inputs, backend), expected))
            except Exception as error:
                skipped.append({"case": case.name, "impl": name, "error": str(error)[:200]})
    for row in rows:
        print(f"{row['case']:>22}  {row['impl']:<24} {row['ms']:9.3f} ms  {row['tflops']:6.1f}")
    return rows, skipped


def label(tiles: PrefillTiles) -> str:
    return f"m{tiles.block_m} n{tiles.block_n} w{tiles.num_warps} s{tiles.num_stages}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--defaults-only", action="store_true", help="no candidate tiles")
    args = parser.parse_args()
    candidates = [] if args.defaults_only else CANDIDATES
    rows, skipped = [], []
    for case in CASES:
        case_rows, case_skipped = sweep_case(case, candidates)
        rows += case_rows
        skipped += case_skipped
        torch.cuda.empty_cache()
    report = {
        "benchmark": "prefill_attention_sweep",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "shape": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "rows": rows,
        "skipped": skipped,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{len(rows)} timed, {len(skipped)} skipped -> {args.out}")


if __name__ == "__main__":
    with exact_stages():  # a candidate runs as labelled, or is skipped as not fitting
        main()
