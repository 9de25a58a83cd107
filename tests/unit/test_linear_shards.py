"""Tensor-parallel cuts of every linear method's loaded tensors (services/executor/
linear_shards.py), on CPU in float32 through the methods' references: the ranks of a
column-parallel layer give the whole layer's output, piece by piece (fused q/k/v keep their
heads apart); the ranks of a row-parallel layer sum to it. Cuts that would split a packed
word, a scale group or a GGUF block are refused."""

from __future__ import annotations

import copy
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kernels.gguf import row_bytes
from services.executor.layers.linear import Linear, LinearMethod, Unquantized
from services.executor.parallel.shards import PackedWeight, Split, packed_dims, shard_tensor
from services.executor.quantization.fp8 import Fp8Block, Fp8Checkpoint, Fp8Dynamic, Fp8Static
from services.executor.quantization.gguf import GgufBlocks
from services.executor.quantization.int4 import Int4WeightOnly
from shared.quant_config import QuantSpec
from sweeps.gguf_writer import random_weight

K, PIECES = 256, (64, 32, 32)  # a fused q/k/v of 128 rows
N = sum(PIECES)
METHODS: dict[str, Callable[[], LinearMethod]] = {
    "bf16": Unquantized,
    "fp8-dynamic": Fp8Dynamic,
    "fp8-channel": Fp8Checkpoint,
    "fp8-static": Fp8Static,
    "fp8-block": lambda: Fp8Block((32, 64)),
    "awq-g32": lambda: Int4WeightOnly(QuantSpec("awq", False, group_size=32)),
    "gptq-act-order": lambda: Int4WeightOnly(
        QuantSpec("gptq", False, group_size=32, symmetric=True, act_order=True)
    ),
    "int4-channel": lambda: Int4WeightOnly(QuantSpec("compressed-tensors", False, group_size=-1)),
}
# Row-parallel FP8 with activations quantized per token: each rank scales its own slice (as
# vLLM's ranks do), so the sum is close to the whole layer's, not equal.
PER_TOKEN_FP8 = {"fp8-dynamic", "fp8-channel", "fp8-block"}


def loaded_layer(name: str, bias: bool, seed: int) -> Linear:
    """A whole layer with random tensors as a checkpoint would load them (not prepared)."""
    layer = Linear(K, N, bias=bias, method=METHODS[name]())
    generator = torch.Generator().manual_seed(seed)
    layer.method.init_dummy(layer, generator)
    if layer.method.shard_dims(layer).get("g_idx") is not None:  # act-order: shuffled groups
        order = torch.randperm(K, generator=generator)
        layer.g_idx.data.copy_((order // 32).to(torch.int32))
    if isinstance(layer.method, Fp8Static):  # a scale per piece, each rank keeps every piece
        scales = torch.rand(len(PIECES), generator=generator) / 20 + 0.01
        layer.input_scale.data.copy_(scales.repeat_interleave(torch.tensor(PIECES)))
    return layer


def rank_layer(whole: Linear, split: Split, rank: int, world: int, fresh: LinearMethod) -> Linear:
    """Rank `rank`'s part, loaded from the whole layer's tensors as they were loaded."""
    k, n = (K // world, N) if split == "cols" else (K, N // world)
    local = Linear(k, n, bias=whole.bias is not None, method=fresh, whole_in_features=K)
    for name, dims in whole.method.shard_dims(whole).items():
        tensor, target = getattr(whole, name), getattr(local, name)
        if tensor is not None and target is not None:
            pieces = PIECES if split == "rows" else None
            target.data.copy_(shard_tensor(tensor.data, dims, split, rank, world, pieces))
    local.method.prepare(local)
    return local


def prepared(layer: Linear) -> Linear:
    layer = copy.deepcopy(layer)
    layer.method.prepare(layer)
    return layer


def column_parallel(outs: list[torch.Tensor], world: int) -> torch.Tensor:
    """The ranks' outputs back in the whole layer's order: each piece's rows, rank by rank."""
    columns, start = [], 0
    for size in PIECES:
        local = size // world
        columns += [out[:, start // world : start // world + local] for out in outs]
        start += size
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("name", sorted(METHODS))
@pytest.mark.parametrize("world", [2, 4])
def test_column_parallel_ranks_give_the_whole_output(name: str, world: int) -> None:
    whole = loaded_layer(name, bias=True, seed=world)
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(1))
    outs = [rank_layer(whole, "rows", r, world, METHODS[name]())(x) for r in range(world)]
    torch.testing.assert_close(column_parallel(outs, world), prepared(whole)(x))


@pytest.mark.parametrize("name", sorted(METHODS))
def test_row_parallel_ranks_sum_to_the_whole_output(name: str) -> None:
    world = 2
    whole = loaded_layer(name, bias=True, seed=3)  # added once: rank 0's
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(2))
    parts = x.chunk(world, dim=1)
    total = sum(rank_layer(whole, "cols", r, world, METHODS[name]())(parts[r]) for r in range(2))
    expected = prepared(whole)(x)
    assert isinstance(total, torch.Tensor)
    if name in PER_TOKEN_FP8:
        error = (total - expected).norm() / expected.norm()
        assert error < 0.05, f"{name}: relative error {error:.3f}"
    else:
        torch.testing.assert_close(total, expected, rtol=1e-4, atol=1e-4)


def test_act_order_ranks_keep_every_group() -> None:
    whole = loaded_layer("gptq-act-order", bias=False, seed=0)
    local = rank_layer(whole, "cols", 1, 4, METHODS["gptq-act-order"]())
    assert local.scales.shape == whole.scales.shape and local.g_idx.shape == (K // 4,)


@pytest.mark.parametrize(
    ("name", "tensor", "world", "what"),
    [
        ("awq-g32", "scales", 16, "cuts groups of 32"),
        ("awq-g32", "qweight", 16, "cuts chunks of packed words of 32"),
        ("fp8-block", "weight_scale", 8, "cuts scale groups of 64"),
    ],
)
def test_cuts_inside_a_block_are_refused(name: str, tensor: str, world: int, what: str) -> None:
    whole = loaded_layer(name, bias=False, seed=0)
    dims = whole.method.shard_dims(whole)[tensor]
    with pytest.raises(ValueError, match=what):
        shard_tensor(getattr(whole, tensor).data, dims, "cols", 0, world)


def test_pieces_that_do_not_split_are_refused() -> None:
    whole = loaded_layer("bf16", bias=False, seed=0)
    with pytest.raises(ValueError, match="does not split 3 ways"):
        shard_tensor(whole.weight.data, whole.method.shard_dims(whole)["weight"], "rows", 0, 3)


# --- GGUF: pieces of raw blocks, cut before the method loads them ------------------------------


def gguf_pieces(seed: int) -> list[PackedWeight]:
    """q and k in Q4_K, v in Q6_K, as Q4_K_M files mix them (K = 512: two 256-value blocks)."""
    rng = np.random.default_rng(seed)
    types = ("Q4_K", "Q4_K", "Q6_K")
    return [
        PackedWeight(
            t, torch.from_numpy(np.ascontiguousarray(random_weight(t, rows, 512, 0.05, rng)))
        )
        for t, rows in zip(types, PIECES, strict=True)
    ]


def gguf_layer(pieces: list[PackedWeight], k: int, split: Split, rank: int, world: int) -> Linear:
    n = N // world if split == "rows" else N
    layer = Linear(k // world if split == "cols" else k, n, method=GgufBlocks())
    start = 0
    for piece in pieces:
        data = shard_tensor(piece.data, packed_dims(piece.qtype), split, rank, world)
        assert data.shape[1] == row_bytes(piece.qtype, layer.in_features)
        layer.method.load_shard(layer, start, PackedWeight(piece.qtype, data))  # type: ignore[attr-defined]
        start += data.shape[0]
    layer.method.prepare(layer)
    return layer


@pytest.mark.parametrize("split", ["rows", "cols"])
def test_gguf_pieces_cut_into_whole_blocks(split: Split) -> None:
    pieces, k, world = gguf_pieces(0), 512, 2
    whole = gguf_layer(pieces, k, "rows", 0, 1)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(0))
    if split == "rows":
        outs = [gguf_layer(pieces, k, "rows", r, world)(x) for r in range(world)]
        torch.testing.assert_close(column_parallel(outs, world), whole(x))
    else:
        parts = x.chunk(world, dim=1)
        total = sum(gguf_layer(pieces, k, "cols", r, world)(parts[r]) for r in range(world))
        torch.testing.assert_close(total, whole(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="Q4_K blocks"):
        gguf_layer(pieces, k, "cols", 0, 4)  # 128 columns a rank: half a block
