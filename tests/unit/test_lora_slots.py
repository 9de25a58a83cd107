"""LoRA slots: PEFT adapters copied into the kernels' layout give, through the batched shrink
and expand, each token exactly its own adapter's delta (peft's merge); the tensor-parallel
ranks' parts of an adapter put together give that delta too; the slot table keeps a step's
adapters resident and evicts the least recently used."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("peft")

from kernels import ops
from services.executor.lora.adapter import TARGETS, LoraAdapter, load_lora_adapter, projection_shape
from services.executor.lora.slots import FUSED, LoraSlots, SlotTable, slot_rank
from services.executor.parallel.layout import ShardLayout
from services.executor.parallel.tensor_parallel import ONE_RANK, TensorParallel
from tests.unit.test_lora_adapter import kvflow_config, merged_deltas, save_adapter

# On a GPU the slots and tokens live there and the batched kernels are Triton's.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_slot_rank_is_a_power_of_two_of_at_least_16() -> None:
    assert [slot_rank(r) for r in (1, 8, 16, 17, 64)] == [16, 16, 16, 32, 64]


def test_each_token_gets_its_own_adapters_delta(tmp_path: Path) -> None:
    cfg = kvflow_config()
    specs = [  # three adapters: all seven projections, attention only (rsLoRA), MLP rank 4
        {},
        {"target_modules": ["q_proj", "v_proj", "o_proj"], "use_rslora": True, "r": 16},
        {"target_modules": ["gate_proj", "down_proj"], "r": 4, "lora_alpha": 4},
    ]
    adapters, deltas = [], []
    for i, spec in enumerate(specs):
        model = save_adapter(tmp_path / str(i), seed=10 + i, **spec)
        adapters.append(load_lora_adapter(f"a{i}", tmp_path / str(i), cfg, 16))
        deltas.append(merged_deltas(model))
    layout = ShardLayout.of(cfg, ONE_RANK)
    slots = LoraSlots(layout, max_loras=4, max_lora_rank=16, dtype=torch.float32, device=DEVICE)
    for slot, adapter in zip((2, 0, 3), adapters, strict=True):
        slots.fill(slot, adapter)
    token_slots = torch.tensor([2, -1, 0, 3, 0, 2], dtype=torch.int32, device=DEVICE)
    which = {2: 0, 0: 1, 3: 2}  # slot -> adapter index
    x = torch.randn(6, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    for layer in range(cfg.num_layers):
        for fused, pieces in FUSED.items():
            projection = slots.layers[layer][fused]
            k = projection.lora_a.shape[-1]
            inputs = x if k == cfg.hidden_size else torch.randn(6, k, device=DEVICE)
            out = torch.zeros(6, sum(projection.piece_rows), device=DEVICE)
            shrunk = ops.lora_shrink(inputs, projection.lora_a, token_slots)
            ops.lora_expand(out, shrunk, projection.lora_b, token_slots, projection.piece_rows)
            for t, slot in enumerate(token_slots.tolist()):
                parts = []
                for piece, rows in zip(pieces, projection.piece_rows, strict=True):
                    delta = deltas[which[slot]].get((layer, piece)) if slot >= 0 else None
                    parts.append(
                        delta @ inputs[t].cpu() if delta is not None else torch.zeros(rows)
                    )
                torch.testing.assert_close(out[t].cpu(), torch.cat(parts), rtol=1e-4, atol=1e-5)


def test_refilling_a_slot_leaves_nothing_of_the_last_adapter(tmp_path: Path) -> None:
    cfg = kvflow_config()
    save_adapter(tmp_path / "all")
    save_adapter(tmp_path / "q", target_modules=["q_proj"])
    layout = ShardLayout.of(cfg, ONE_RANK)
    slots = LoraSlots(layout, max_loras=1, max_lora_rank=16, dtype=torch.float32, device="cpu")
    slots.fill(0, load_lora_adapter("all", tmp_path / "all", cfg, 16))
    slots.fill(0, load_lora_adapter("q", tmp_path / "q", cfg, 16))
    assert not slots.layers[0]["down_proj"].lora_b.any()
    assert not slots.layers[1]["qkv_proj"].lora_a[0, 1:].any()  # k and v: untouched by "q"
    with pytest.raises(ValueError, match="outside"):
        slots.clear(1)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-heads-split", "kv-head-shared"])
def test_the_ranks_parts_of_an_adapter_make_its_delta(kv_heads: int) -> None:
    """Two ranks' slots: each rank's B A of a projection is its part of the adapter's delta,
    cut as the base layer's weight is. Column-parallel projections: the rows of its heads or
    columns (a KV head both ranks share: its rows on each), so the ranks' outputs side by side
    are the delta's; row-parallel: the columns of its input, so their partial outputs sum to
    the delta's."""
    cfg = dataclasses.replace(kvflow_config(), num_kv_heads=kv_heads)
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for target in TARGETS:
        out_features, in_features = projection_shape(cfg, target)
        a = torch.randn(4, in_features, generator=generator)
        weights[(1, target)] = (a, torch.randn(out_features, 4, generator=generator))
    adapter = LoraAdapter("a", Path("a"), 4, 0.5, TARGETS, weights)
    kv_rows = cfg.num_kv_heads * cfg.head_dim // 2 if kv_heads == 2 else cfg.head_dim
    for rank in range(2):
        slots = LoraSlots(
            ShardLayout.of(cfg, TensorParallel(rank=rank, size=2)), 1, 16, torch.float32, "cpu"
        )
        slots.fill(0, adapter)
        for fused, pieces in FUSED.items():
            projection = slots.layers[1][fused]
            starts = [sum(projection.piece_rows[:p]) for p in range(len(pieces))]
            for piece, (target, start) in enumerate(zip(pieces, starts, strict=True)):
                rows = projection.piece_rows[piece]
                got = projection.lora_b[0, start : start + rows] @ projection.lora_a[0, piece]
                delta = adapter.delta(1, target)
                assert delta is not None
                if fused in ("o_proj", "down_proj"):
                    width = delta.shape[1] // 2
                    expected = delta[:, rank * width : (rank + 1) * width]
                elif target in ("k_proj", "v_proj"):
                    first = rank * kv_rows if kv_heads == 2 else 0
                    expected = delta[first : first + kv_rows]
                else:
                    expected = delta[rank * rows : (rank + 1) * rows]
                torch.testing.assert_close(got, expected, msg=f"rank {rank} {target}")


def test_the_table_keeps_a_steps_adapters_and_evicts_the_least_recently_used() -> None:
    table = SlotTable(max_loras=2)
    slots, fill = table.assign({1, 2})
    assert sorted(slots.values()) == [0, 1] and fill == slots
    assert table.assign({1}) == ({1: slots[1]}, {})  # resident: nothing to fill
    step, fill = table.assign({1, 3})  # 2 is the least recently used
    assert fill == {3: slots[2]} and step[1] == slots[1]
    assert table.forget(1) == slots[1] and 1 not in table.resident()
    with pytest.raises(ValueError, match="--max-loras"):
        table.assign({7, 8, 9})


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sets(st.integers(1, 6), min_size=1, max_size=3), max_size=30))
def test_every_step_has_its_adapters_in_distinct_slots(steps: list[set[int]]) -> None:
    table = SlotTable(max_loras=3)
    contents: dict[int, int] = {}  # what each slot holds, as the fills left it
    for adapters in steps:
        slots, fill = table.assign(adapters)
        for name, slot in fill.items():
            contents[slot] = name
        assert set(slots) == adapters and len(set(slots.values())) == len(adapters)
        assert all(contents[slot] == name for name, slot in slots.items())
        assert table.resident() == {name: s for s, name in contents.items()}
