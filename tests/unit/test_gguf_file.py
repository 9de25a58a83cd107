"""shared/gguf_file.py, our GGUF header reader, against the gguf package's reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from shared.gguf_file import read_gguf
from shared.model_config import resolve_model_source

SOURCE = resolve_model_source(None)


def test_the_header_reader_reads_what_the_gguf_package_reads() -> None:
    ours, theirs = read_gguf(SOURCE.path), GGUFReader(str(SOURCE.path))
    for key, field in theirs.fields.items():
        if not key.startswith("GGUF."):  # the reader's own: version and counts
            value = ours.fields[key]
            assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents()
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, other in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.qtype, mine.shape) == (
            other.name,
            other.tensor_type,
            tuple(other.shape.tolist()),
        )
        assert mine.data.dtype == other.data.dtype
        assert np.array_equal(mine.data, other.data)


def test_a_file_that_is_not_gguf_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(path)
    path.write_bytes(b"GGUF" + (7).to_bytes(4, "little") + bytes(16))
    with pytest.raises(ValueError, match="GGUF version 7 is not supported"):
        read_gguf(path)
