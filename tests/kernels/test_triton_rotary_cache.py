"""The fused q/k norm + rotary + KV-cache write kernel against its torch reference.

Inputs are laid out as in the decoder: q/k/v are strided views into one fused qkv output, the
caches are the two halves of one [2, num_blocks, block_size, KV, D] tensor, poisoned with NaN
first so that a write to any slot not named in slot_mapping shows. On CPU the kernel runs under
the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so CPU shapes are small.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from kernels import triton_rotary_cache
from kernels.rotary_cache import rotary_write_kv_reference
from kernels.triton_rotary_cache import rotary_write_kv
from services.executor.layers.rotary import RotaryEmbedding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EPS = 1e-6
TIGHT = {"rtol": 1e-5, "atol": 1e-5}
LLAMA3_SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(device=DEVICE, dtype=dtype)


def rel_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    return ((out.float() - expected.float()).norm() / expected.float().norm()).item()


def assert_matches(out: torch.Tensor, expected: torch.Tensor) -> None:
    """Tight in float32; in half precision the reference rotates in that dtype, not float32."""
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, **TIGHT)
    else:
        assert rel_error(out, expected) < 1e-2


@functools.cache
def cos_sin_cache(head_dim: int, max_position: int, theta: float, llama3: bool) -> torch.Tensor:
    scaling = LLAMA3_SCALING if llama3 else None
    return RotaryEmbedding(head_dim, max_position, theta, scaling).cos_sin_cache.to(DEVICE)


class Case:
    """One call's inputs: q/k/v views into qkv, a NaN-poisoned kv_cache, some padding tokens."""

    def __init__(
        self,
        shape: tuple[int, int, int, int],  # (T, H, KV, D)
        dtype: torch.dtype,
        qk_norm: bool,
        seed: int,
        num_padding: int = 2,
        block_size: int = 4,
        cache: torch.Tensor | None = None,  # [max_position, 2, D]; plain RoPE table if None
        index_dtype: torch.dtype = torch.int64,
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        num_tokens, num_heads, num_kv_heads, head_dim = shape
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen, dtype=dtype)
        q, k, v = self.qkv.split([q_size, kv_size, kv_size], dim=-1)
        self.q = q.view(num_tokens, num_heads, head_dim)  # [T, H, D]
        self.k = k.view(num_tokens, num_kv_heads, head_dim)  # [T, KV, D]
        self.v = v.view(num_tokens, num_kv_heads, head_dim)  # [T, KV, D]
        self.cos_sin_cache = cos_sin_cache(head_dim, 64, 10000.0, False) if cache is None else cache
        max_position = self.cos_sin_cache.shape[0]
        positions = torch.randint(0, max_position, (num_tokens,), generator=gen)
        num_blocks = num_tokens // block_size + 3
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
        slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
        self.slots = slots  # [T] on the CPU, for indexing below
        self.positions = positions.to(DEVICE, index_dtype)
        self.slot_mapping = slots.to(DEVICE, index_dtype)
        shape5 = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.full(shape5, float("nan"), dtype=dtype, device=DEVICE)
        self.q_norm_weight = randn(head_dim, gen=gen, dtype=dtype) if qk_norm else None
        self.k_norm_weight = randn(head_dim, gen=gen, dtype=dtype) if qk_norm else None

    def args(self, kv_cache: torch.Tensor) -> dict[str, Any]:
        return {
            "positions": self.positions,
            "query": self.q,
            "key": self.k,
            "value": self.v,
            "cos_sin_cache": self.cos_sin_cache,
            "key_cache": kv_cache[0],
            "value_cache": kv_cache[1],
            "slot_mapping": self.slot_mapping,
            "q_norm_weight": self.q_norm_weight,
            "k_norm_weight": self.k_norm_weight,
            "eps": EPS,
        }

    def run_both(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(expected query, expected kv_cache, query out): the reference first, on clones.

        Checks that the kernel returned the query itself, rotated where it lies in qkv, and
        left K and V there as they were (K is rotated only into the cache).
        """
        ref_cache = self.kv_cache.clone()
        k_before, v_before = self.k.clone(), self.v.clone()
        args = self.args(ref_cache)
        args.update(query=self.q.clone(), key=k_before, value=v_before)
        expected_q = rotary_write_kv_reference(**args)
        q_out = rotary_write_kv(**self.args(self.kv_cache))
        assert q_out is self.q and q_out.data_ptr() == self.qkv.data_ptr()
        assert torch.equal(self.k, k_before) and torch.equal(self.v, v_before)
        return expected_q, ref_cache, q_out

    def check_cache(self, ref_cache: torch.Tensor) -> None:
        """Exactly the real slots changed, to the reference's K (see assert_matches) and V."""
        num_kv_heads, head_dim = self.k.shape[1:]
        flat = self.kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, slots, KV, D]
        ref_flat = ref_cache.view(2, -1, num_kv_heads, head_dim)
        written = self.slots[self.slots >= 0].to(DEVICE)
        untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert flat[:, untouched].isnan().all()  # padding wrote nothing, not even at slot -1
        assert not flat[:, written].isnan().any()
        assert_matches(flat[0, written], ref_flat[0, written])
        assert torch.equal(flat[1, written], ref_flat[1, written])  # V is copied as is


# --- CPU: the Triton interpreter on small shapes -----------------------------------------------

SMALL_SHAPES = [(9, 4, 2, 16), (7, 6, 2, 40), (5, 3, 3, 8)]  # (T, H, KV, D): GQA, odd half, MHA


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("shape", SMALL_SHAPES)
def test_float32_matches_reference(shape: tuple[int, int, int, int], qk_norm: bool) -> None:
    case = Case(shape, torch.float32, qk_norm, seed=sum(shape) + qk_norm)
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_bfloat16_matches_reference(qk_norm: bool) -> None:
    case = Case((8, 8, 2, 32), torch.bfloat16, qk_norm, seed=20 + qk_norm, num_padding=3)
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_llama3_scaled_table_at_long_positions(index_dtype: torch.dtype) -> None:
    cache = cos_sin_cache(32, 32768, 500000.0, True)
    case = Case((6, 4, 1, 32), torch.float32, False, seed=30, cache=cache, index_dtype=index_dtype)
    case.positions[0] = 32767  # the table's last row
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


@pytest.mark.parametrize(
    ("shape", "tile_elements", "num_head_blocks"),
    [
        ((5, 6, 3, 16), 64, 4),  # 2 q + 1 KV heads a program; the last past both H and KV
        ((5, 6, 3, 16), 1, 6),  # 1 + 1: programs 3 to 5 past KV
        ((3, 12, 6, 16), 192, 2),  # 6 + 3 heads in blocks of 8 + 4: masked within a block
    ],
)
def test_heads_split_over_programs(
    monkeypatch: pytest.MonkeyPatch,
    shape: tuple[int, int, int, int],
    tile_elements: int,
    num_head_blocks: int,
) -> None:
    """Small tiles force several programs per token, as real shapes get on the GPU."""
    monkeypatch.setattr(triton_rotary_cache, "_TILE_ELEMENTS", tile_elements)
    num_heads, num_kv_heads, head_dim = shape[1:]
    assert triton_rotary_cache._num_head_blocks(num_heads, num_kv_heads, head_dim // 2) == (
        num_head_blocks
    )
    case = Case(shape, torch.float32, True, seed=35 + tile_elements)
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


def test_llama_8b_runs_four_programs_per_token() -> None:
    assert triton_rotary_cache._num_head_blocks(32, 8, 64) == 4  # each 8 q + 2 KV heads


def test_uses_both_halves_of_the_table() -> None:
    """A table whose halves differ still matches the reference: no half is assumed repeated."""
    gen = torch.Generator().manual_seed(36)
    case = Case((4, 2, 1, 8), torch.float32, False, seed=36, cache=randn(16, 2, 8, gen=gen))
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


def test_only_k_norm() -> None:
    """The two norm weights are independent: a model could norm k alone."""
    case = Case((4, 2, 2, 16), torch.float32, True, seed=40, num_padding=0)
    case.q_norm_weight = None
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


def test_all_padding_writes_nothing_but_still_rotates_the_query() -> None:
    case = Case((3, 2, 1, 16), torch.float32, True, seed=50, num_padding=3)
    expected_q, _, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    assert case.kv_cache.isnan().all()


def test_no_tokens_is_a_no_op() -> None:
    case = Case((0, 2, 1, 16), torch.float32, False, seed=60, num_padding=0)
    assert rotary_write_kv(**case.args(case.kv_cache)) is case.q
    assert case.kv_cache.isnan().all()


def _odd_head_dim(case: Case) -> dict[str, Any]:
    return {"query": case.q[..., :-1], "key": case.k[..., :-1], "value": case.v[..., :-1]}


BAD_INPUTS: dict[str, tuple[Callable[[Case], dict[str, Any]], str]] = {
    "2-D query": (lambda c: {"query": c.q.flatten(1)}, "must be"),
    "value unlike key": (lambda c: {"value": c.v[:, :1]}, "must be"),
    "odd head_dim": (_odd_head_dim, "odd"),
    "key tokens": (lambda c: {"key": c.k[:-1], "value": c.v[:-1]}, "disagree"),
    "short positions": (lambda c: {"positions": c.positions[:-1]}, "positions"),
    "float positions": (lambda c: {"positions": c.positions.float()}, "int32 or int64"),
    "short slots": (lambda c: {"slot_mapping": c.slot_mapping[:-1]}, "slot_mapping"),
    "strided head dim": (
        lambda c: {"query": c.q.transpose(1, 2).contiguous().transpose(1, 2)},
        "contiguous",
    ),
    "cos_sin head_dim": (lambda c: {"cos_sin_cache": c.cos_sin_cache[..., :4]}, "cos_sin"),
    "cache KV heads": (lambda c: {"key_cache": c.kv_cache[0][:, :, :1]}, "key_cache"),
    "value_cache shape": (lambda c: {"value_cache": c.kv_cache[1][:1]}, "value_cache"),
    "norm weight": (lambda c: {"q_norm_weight": torch.ones(3, device=DEVICE)}, "q_norm_weight"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise(name: str) -> None:
    case = Case((4, 4, 2, 16), torch.float32, False, seed=70)
    make_overrides, message = BAD_INPUTS[name]
    args = case.args(case.kv_cache) | make_overrides(case)
    with pytest.raises(ValueError, match=message):
        rotary_write_kv(**args)


# --- GPU: real shapes in half precision ---------------------------------------------------------

HALF_DTYPES = [torch.bfloat16, torch.float16]
LLAMA_8B = (32, 8, 128)  # Llama-3.1-8B and Qwen3-8B alike: (H, KV, D)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", HALF_DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 64, 2048])
@pytest.mark.parametrize("model", ["llama-3.1-8b", "qwen3-8b"])
def test_gpu_real_shapes(model: str, num_tokens: int, dtype: torch.dtype) -> None:
    llama = model == "llama-3.1-8b"
    # Llama 3.1: theta 5e5 with the long-context scaling; Qwen3: theta 1e6 and q/k norm.
    cache = cos_sin_cache(128, 131072, 500000.0 if llama else 1e6, llama)
    case = Case(
        (num_tokens, *LLAMA_8B),
        dtype,
        qk_norm=not llama,
        seed=num_tokens,
        num_padding=num_tokens // 8,  # a padded CUDA-graph batch
        block_size=16,
        cache=cache,
        index_dtype=torch.int32,
    )
    expected_q, ref_cache, q_out = case.run_both()
    assert_matches(q_out, expected_q)
    case.check_cache(ref_cache)


@pytest.mark.gpu
@gpu
def test_gpu_replays_in_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs in the same buffers: no sync, no allocation."""
    case = Case((8, *LLAMA_8B), torch.bfloat16, True, seed=80, block_size=16)
    fresh = Case((8, *LLAMA_8B), torch.bfloat16, True, seed=81, block_size=16)
    args = case.args(case.kv_cache)
    rotary_write_kv(**args)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_write_kv(**args)
    for name in ("qkv", "positions", "slot_mapping", "kv_cache", "q_norm_weight", "k_norm_weight"):
        getattr(case, name).copy_(getattr(fresh, name))
    case.slots = fresh.slots
    ref_cache = fresh.kv_cache.clone()
    expected_q = rotary_write_kv_reference(**fresh.args(ref_cache))

    graph.replay()

    assert_matches(case.q, expected_q)
    case.check_cache(ref_cache)
