"""Hugging Face safetensors folders as a stream of (name, tensor): read whole, or as slices a
tensor-parallel rank cuts before reading."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from services.executor.parallel.shards import CheckpointSlice


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        paths = [folder / f for f in files]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    return paths


def safetensors_names(folder: Path) -> set[str]:
    """Every tensor name of the checkpoint, from the files' headers (no tensor is read)."""
    names: set[str] = set()
    for path in safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def _open_tensors(folder: Path) -> Iterator[tuple[Any, str]]:
    """(open file, tensor name) of every tensor of the checkpoint, file by file; every file
    stays open to the end, for slices read later (a quantized module's parts may sit in
    several files)."""
    with contextlib.ExitStack() as files:
        for path in safetensors_files(folder):
            f = files.enter_context(safe_open(str(path), framework="pt"))
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield f, name


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for f, name in _open_tensors(folder):
        yield name, f.get_tensor(name)


def iter_safetensor_slices(folder: Path) -> Iterator[tuple[str, CheckpointSlice]]:
    """The checkpoint's tensors unread: a tensor-parallel rank reads only its part of each."""
    for f, name in _open_tensors(folder):
        yield name, CheckpointSlice(f.get_slice(name))
