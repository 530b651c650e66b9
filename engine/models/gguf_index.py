"""A GGUF file's tensors without its metadata: name, type, shape and the
bytes (mapped, not read).

gguf's GGUFReader turns every metadata field into arrays first; a model's
tokenizer vocabulary and merges are in there (the default model: about
100,000 strings), and that took 4.5 of the 8 s of a first load that recovers
the 4-bit blocks.  The metadata is only skipped here, by its lengths.  The
layout is the GGUF format's (version 2 and 3): header, metadata key-values,
tensor infos, then the tensor data at the file's alignment.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = 0x46554747  # "GGUF", little-endian
STRING, ARRAY = 8, 9
# Scalar value types -> bytes: u8 i8 u16 i16 u32 i32 f32 bool u64 i64 f64.
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: shape[0] is a row's length
    data: np.ndarray  # uint8 [rows, bytes per row], mapped from the file


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.off = memoryview(buf.data), 0  # type: ignore[arg-type]

    def take(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.buf, self.off)
        self.off += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        return self.take("<I")[0]

    def u64(self) -> int:
        return self.take("<Q")[0]

    def string(self) -> str:
        n = self.u64()
        s = str(self.buf[self.off:self.off + n], "utf-8")
        self.off += n
        return s

    def skip(self, vtype: int) -> None:
        if vtype in SCALAR_BYTES:
            self.off += SCALAR_BYTES[vtype]
        elif vtype == STRING:
            n = self.u64()  # (not `self.off += self.u64()`: that adds to the offset before the read)
            self.off += n
        elif vtype == ARRAY:
            itype, count = self.u32(), self.u64()
            if itype in SCALAR_BYTES:
                self.off += SCALAR_BYTES[itype] * count
            else:
                for _ in range(count):
                    self.skip(itype)
        else:
            raise ValueError(f"GGUF: unknown metadata value type {vtype} at byte {self.off}")


def gguf_tensors(path: Path | str) -> list[GGUFTensor]:
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    c = _Cursor(buf)
    magic, version = c.take("<II")
    if magic != MAGIC or version < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    n_tensors, n_kv = c.take("<QQ")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key, vtype = c.string(), c.u32()
        if key == "general.alignment" and vtype == 4:
            alignment = c.u32()
        else:
            c.skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = c.string()
        dims = c.take(f"<{c.u32()}Q")
        ttype, offset = c.u32(), c.u64()
        infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(ttype), offset))
    start = -(-c.off // alignment) * alignment
    out = []
    for name, dims, ttype, offset in infos:
        block, type_bytes = GGML_QUANT_SIZES[ttype]
        row_bytes = dims[0] // block * type_bytes
        rows = math.prod(dims[1:])
        at = start + offset
        out.append(GGUFTensor(name, ttype, dims, buf[at:at + rows * row_bytes].reshape(rows, row_bytes)))
    return out
