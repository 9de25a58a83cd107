"""A GGUF file's header read in one pass: its metadata fields and where each tensor lies.

Why not `gguf.GGUFReader`: it builds a numpy view for every part of every field, so a 100 MB
model whose tokenizer holds 100k strings takes 2 s of CPU to open, and each process that
starts (executor, tokenizer workers, the launcher) opened it several times. Here the header
is read with `struct` from the memory-mapped file (about 0.1 s); tensors stay in the map until
a rank reads the part it takes. The format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types (the spec's gguf_metadata_value_type) with fixed sizes -> struct format.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
# Tensor element types numpy reads as they are stored; any other type is read as bytes.
_TYPED = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GgufTensor:
    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: the row length first
    # Stored rows, outermost first: [*reversed(shape)] values for the typed element types,
    # [*reversed(shape[1:]), bytes of a row] for block-quantized (and BF16) ones. Read-only.
    data: np.ndarray


@dataclass(frozen=True)
class GgufFile:
    fields: dict[str, Any]  # numeric arrays as numpy arrays, string arrays as lists
    tensors: list[GgufTensor]


def read_gguf(path: Path) -> GgufFile:
    """Open `path`; raises ValueError for a file that is not GGUF version 2 or 3."""
    with open(path, "rb") as file:
        buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    header = _Header(buffer)
    if header.take(4) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, num_tensors, num_fields = header.unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
    fields = {header.string(): header.value() for _ in range(num_fields)}
    infos = [header.tensor_info() for _ in range(num_tensors)]
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = -(-header.offset // alignment) * alignment
    whole = np.frombuffer(buffer, dtype=np.uint8)
    tensors = [_tensor(whole, data_start, *info) for info in infos]
    return GgufFile(fields, tensors)


def _tensor(
    whole: np.ndarray, data_start: int, name: str, shape: tuple[int, ...], qtype: int, offset: int
) -> GgufTensor:
    kind = GGMLQuantizationType(qtype)
    block_elems, block_bytes = GGML_QUANT_SIZES[kind]
    rows = tuple(reversed(shape))
    num_bytes = int(np.prod(shape)) * block_bytes // block_elems
    raw = whole[data_start + offset : data_start + offset + num_bytes]
    if kind in _TYPED:
        data = raw.view(_TYPED[kind]).reshape(rows)
    else:
        data = raw.reshape(*rows[:-1], rows[-1] // block_elems * block_bytes)
    return GgufTensor(name, kind, shape, data)


class _Header:
    """A cursor over the header's little-endian values."""

    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.offset = buffer, 0

    def take(self, size: int) -> bytes:
        chunk = self.buffer[self.offset : self.offset + size]
        if len(chunk) != size:
            raise ValueError("the GGUF header ends early")
        self.offset += size
        return chunk

    def unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (size,) = self.unpack("<Q")
        return self.take(size).decode("utf-8", errors="replace")

    def value(self, kind: int | None = None) -> Any:
        if kind is None:
            (kind,) = self.unpack("<I")
        if kind in _SCALARS:
            return self.unpack("<" + _SCALARS[kind])[0]
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        item_kind, count = self.unpack("<IQ")
        if item_kind in _SCALARS:  # one numpy read, not `count` unpacks
            dtype = np.dtype("<" + _SCALARS[item_kind])
            array = np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype)
            return array
        return [self.value(item_kind) for _ in range(count)]

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string()
        (num_dims,) = self.unpack("<I")
        shape = self.unpack(f"<{num_dims}Q")
        qtype, offset = self.unpack("<IQ")
        return name, tuple(shape), qtype, offset
