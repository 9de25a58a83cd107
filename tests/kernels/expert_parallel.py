"""What the expert kernels' tests share for expert parallelism: ids as a rank sees them (other
ranks' choices are expert -1), and poison where a kernel must not read: expert 0's weights
(the index an expert of -1 is clamped to), and every buffer torch.empty hands out."""

from __future__ import annotations

import pytest
import torch


def another_ranks(ids: torch.Tensor) -> torch.Tensor:
    """ids as a rank sees them with expert parallelism (services/executor/layers/moe.py) if
    each token's every second choice, and all of token 0's (given two tokens or more), are
    other ranks' experts: -1."""
    ids = ids.clone()
    ids[:, 1::2] = -1
    if len(ids) > 1:
        ids[0] = -1
    return ids


def nan_expert_0(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of an expert tensor ([E, ...]) whose expert 0 is NaN."""
    tensor = tensor.clone()
    tensor[0] = float("nan")
    return tensor


def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on torch.empty's float tensors come filled with NaN: a row that a kernel
    should have written, or should not have read, shows."""
    empty = torch.empty

    def filled(*args: object, **kwargs: object) -> torch.Tensor:
        tensor = empty(*args, **kwargs)  # type: ignore[call-overload]
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", filled)


def first_experts(ids: torch.Tensor, count: int) -> torch.Tensor:
    """ids as the rank holding the first `count` experts sees them (at least one choice its
    own and one another rank's)."""
    local = torch.where(ids < count, ids, -1)
    assert (local >= 0).any() and (local < 0).any()
    return local


def record_calls(monkeypatch: pytest.MonkeyPatch, module: object, *names: str) -> list[str]:
    """The names of `module`'s functions among `names` as they are called from now on."""
    called: list[str] = []
    for name in names:
        function = getattr(module, name)

        def recorded(*args: object, name: str = name, function=function, **kwargs: object):  # type: ignore[no-untyped-def]
            called.append(name)
            return function(*args, **kwargs)

        monkeypatch.setattr(module, name, recorded)
    return called
