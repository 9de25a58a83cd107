"""How a linear layer's loaded tensors split across tensor-parallel ranks.

A column-parallel layer (qkv_proj, gate_up_proj) splits its output rows: each rank keeps its
part of every fused piece (its q, k and v heads; its gate and up rows), and its output feeds
only its own heads. A row-parallel layer (o_proj, down_proj) splits its input columns: each
rank multiplies its part of the input, and the ranks' outputs are summed (so its bias stays
on rank 0 alone, zeros on the others).

Each linear method says, for every tensor it loads, which dimension runs along the output rows
and which along the input columns, and in what blocks (`TensorDims`, from the method's
`shard_dims`); `shard_tensor` cuts a checkpoint tensor by that, in the layout the layer loads
(after services/executor/quantization/checkpoints.py's translation, which reads only what the
cut takes), so that a rank reads and copies in only its part and its method prepares that
part as it would a whole layer. GGUF pieces, which the method loads itself, are cut by the
dimensions of `packed_dims`. Quantized formats decide where a cut may fall: whole packed
words, whole scale groups, whole GGUF blocks; a split that would cut one is refused by name.

Which part a rank takes is the layer's to say (`Sharding`, built by `ShardLayout`): each
checkpoint tensor is one piece of the layer (q, k or v of a fused qkv_proj), and the rank takes
part `part` of `parts` equal ones of it: its own heads or columns, or the one KV head it shares
with other ranks when there are fewer KV heads than ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from kernels.gguf import GGUF_TYPES

Split = Literal["rows", "cols"]  # column-parallel: output rows; row-parallel: input columns


@dataclass(frozen=True)
class TensorDims:
    """Where a loaded tensor's output rows and input columns lie."""

    rows: int | None = 0  # the dimension indexed by output row; None: one for all rows
    cols: int | None = None  # the dimension indexed by input column; None: one for all columns
    # (columns, entries): every `columns` input columns take `entries` entries along `cols`
    # (8 columns a packed int4 word, a group's columns a scale, 256 values 144 bytes of Q4_K)
    col_block: tuple[int, int] = (1, 1)
    what: str = "columns"  # what a block is, for the refusal: "packed words", "groups", ...
    added: bool = False  # added to the output (a bias): split by columns, rank 0 keeps it


class CheckpointSlice:
    """A checkpoint tensor not read yet (safetensors' `get_slice`): its shape, and a `narrow`
    that reads only that part, so that a rank reads only its cut of the file."""

    def __init__(self, part: Any) -> None:
        self._part = part
        self.shape = torch.Size(part.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = [slice(None)] * len(self.shape)
        index[dim] = slice(start, start + length)
        tensor: torch.Tensor = self._part[tuple(index)]
        return tensor

    def read(self) -> torch.Tensor:
        tensor: torch.Tensor = self._part[...]  # a scalar too
        return tensor


Loaded = torch.Tensor | CheckpointSlice


@dataclass(frozen=True)
class PackedWeight:
    """A checkpoint weight in a form only its layer's method reads (a GGUF tensor's blocks):
    the parameter it is handed to keeps it for its method, rather than copying it in."""

    qtype: str  # a kernels.gguf type, or "float": `data` is the weight itself
    data: Loaded  # [rows, row_bytes] uint8, or [rows, K] float; read once cut for the rank


CheckpointTensor = Loaded | PackedWeight  # what a checkpoint source yields


def read(tensor: Loaded) -> torch.Tensor:
    """The tensor itself, read from its file if it was not yet."""
    return tensor.read() if isinstance(tensor, CheckpointSlice) else tensor


def shard_tensor(
    tensor: Loaded,
    dims: TensorDims,
    split: Split,
    rank: int,
    world: int,
    pieces: Sequence[int] | None = None,  # rows of each fused piece, in order; None: one
) -> Loaded:
    """Rank `rank`'s part of a loaded tensor (a view where it can be; of a CheckpointSlice,
    only that part read, or the slice itself where nothing is cut)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a group of {world}")
    if split == "rows":
        if dims.rows is None:
            return tensor
        sizes = list(pieces) if pieces is not None else [tensor.shape[dims.rows]]
        if sum(sizes) != tensor.shape[dims.rows]:
            raise ValueError(f"pieces of {sizes} rows do not make {tensor.shape[dims.rows]}")
        parts, start = [], 0
        for size in sizes:
            if size % world:
                raise ValueError(f"a piece of {size} output rows does not split {world} ways")
            local = size // world
            parts.append(tensor.narrow(dims.rows, start + rank * local, local))
            start += size
        return parts[0] if len(parts) == 1 else torch.cat([read(p) for p in parts], dims.rows)
    if pieces is not None:
        raise ValueError("pieces are rows of a fused layer: a split by columns takes none")
    if dims.added:  # the ranks' outputs are summed: added once
        return tensor if rank == 0 else torch.zeros_like(read(tensor))
    if dims.cols is None:
        return tensor
    columns, entries = dims.col_block
    total = tensor.shape[dims.cols] // entries * columns  # the layer's input columns
    local = _local_columns(total, world, columns, dims.what)
    width = local // columns * entries
    return tensor.narrow(dims.cols, rank * width, width)


@dataclass(frozen=True)
class Piece:
    """One checkpoint tensor's share of a layer on this rank (a fused layer has several: q, k
    and v; gate and up): `rows` output rows of the layer, cut as part `part` of `parts` equal
    ones of the checkpoint tensor (of its rows in a column-parallel layer, of its columns in a
    row-parallel one)."""

    rows: int
    part: int = 0
    parts: int = 1


@dataclass(frozen=True)
class Sharding:
    """How a layer of this rank holds its checkpoint tensors: split by output rows
    (column-parallel), by input columns (row-parallel) or not at all (None: whole on every
    rank), and its pieces in the order of its output rows."""

    split: Split | None
    pieces: tuple[Piece, ...]

    @classmethod
    def whole(cls, rows: int) -> Sharding:
        return cls(None, (Piece(rows),))

    @property
    def rows(self) -> int:
        return sum(piece.rows for piece in self.pieces)

    def piece_rows(self, shard: int | None) -> tuple[int, int]:
        """(start, rows): where piece `shard` lies in the layer's output rows (None: all)."""
        if shard is None:
            return 0, self.rows
        return sum(piece.rows for piece in self.pieces[:shard]), self.pieces[shard].rows

    def cut(self, tensor: Loaded, dims: TensorDims, shard: int | None) -> Loaded:
        """This rank's part of a checkpoint tensor of piece `shard` (None: the layer's one
        piece), by where the tensor holds rows and columns (`dims`); uncut where the rank
        holds it whole."""
        piece = self.pieces[shard or 0]
        if self.split is None or piece.parts == 1:
            return tensor
        return shard_tensor(tensor, dims, self.split, piece.part, piece.parts)


def packed_dims(qtype: str) -> TensorDims:
    """Where a GGUF piece [rows, row_bytes] (blocks of `qtype`; "float": values) holds rows
    and input columns: a rank's cut takes rows, or the bytes of its columns' whole blocks."""
    if qtype == "float":
        return TensorDims(rows=0, cols=1)
    t = GGUF_TYPES[qtype]
    return TensorDims(0, 1, (t.block_elems, t.block_bytes), f"{qtype} blocks")


def _local_columns(total: int, world: int, block: int, what: str) -> int:
    if total % world:
        raise ValueError(f"{total} input columns do not split {world} ways")
    local = total // world
    if local % block:
        raise ValueError(
            f"{total} input columns split {world} ways leave {local} a rank, which cuts "
            f"{what} of {block} columns"
        )
    return local
