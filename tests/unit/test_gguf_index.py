"""engine/models/gguf_index.py reads a GGUF's tensors as gguf's own reader
does (names, types, shapes, the same bytes), skipping the metadata.  (The
default model's Q4_1 tensors are checked on every load: pack_linears holds
each recovered 4-bit weight equal to the converted floats, bit for bit.)"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from engine.models.gguf_index import gguf_tensors
from tests.quant_ref import write_tiny_gguf


def same_as_gguf_reader(path: Path) -> set[str]:
    mine, ref = gguf_tensors(path), GGUFReader(str(path)).tensors
    assert [t.name for t in mine] == [t.name for t in ref]
    for a, b in zip(mine, ref, strict=True):
        assert a.tensor_type == b.tensor_type and list(a.shape) == [int(x) for x in b.shape], a.name
        expected = np.asarray(b.data)
        assert np.array_equal(a.data.view(expected.dtype).reshape(expected.shape), expected), a.name
    return {t.tensor_type.name for t in mine}


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_tiny_ggufs_of_each_type(tmp_path: Path, qtype: str) -> None:
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_tiny_gguf(str(path), qtype)
    assert qtype in same_as_gguf_reader(path)


def test_not_a_gguf_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        gguf_tensors(path)
