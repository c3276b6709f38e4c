"""Whether a model on disk is whole: the size its own header promises, for GGUF and safetensors.

A download that stopped early leaves a file that starts well and ends short; the engine then
fails minutes into loading, or reads garbage. Both formats say in their header where the last
tensor ends:
- safetensors: an 8-byte little-endian header length N, N bytes of JSON giving each tensor's
  `data_offsets` [begin, end) in the data that follows; the file is 8 + N + the largest end.
- GGUF (v2 and v3): magic "GGUF", version, tensor and metadata counts, the metadata key/values,
  then per tensor its name, dimensions, ggml type and offset; the data starts at the next
  multiple of `general.alignment` (32 unless set) and the last tensor ends at its offset plus its
  size, from the ggml type's block size and bytes per block.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# ggml type: (elements per block, bytes per block), for the types GGUF files commonly hold.
GGML_TYPES: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 36),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    30: (1, 2),  # BF16
}
# GGUF metadata value types with a fixed size; 8 is a string, 9 an array.
FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
MAX_HEADER = 256 * 1024**2  # a header beyond this is not one


class BadModel(Exception):
    """The file is not the format it claims, or is cut short."""


@dataclass(frozen=True)
class Whole:
    size: int  # bytes on disk
    expected: int | None  # bytes the header promises; None when a tensor type is unknown
    tensors: int


def check_safetensors(path: Path) -> Whole:
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise BadModel(f"{size} bytes: too short for a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(size, MAX_HEADER):
            raise BadModel(f"header length {n} does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n))
            ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError):
            raise BadModel("the safetensors header is not valid JSON with data_offsets") from None
    expected = 8 + n + max(ends, default=0)
    return Whole(size, expected, len(ends))


class _Reader:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def take(self, fmt: str) -> int:
        width = struct.calcsize(fmt)
        data = self.f.read(width)
        if len(data) < width:
            raise BadModel("the GGUF header ends early")
        return int(struct.unpack(fmt, data)[0])

    def string(self) -> bytes:
        n = self.take("<Q")
        if n > MAX_HEADER:
            raise BadModel(f"a GGUF string of {n} bytes")
        data = self.f.read(n)
        if len(data) < n:
            raise BadModel("the GGUF header ends early")
        return data

    def value(self, kind: int) -> int | bytes | None:
        """One metadata value: an integer where the type is one, else read past it."""
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.take("<I"), self.take("<Q")
            if count > MAX_HEADER:
                raise BadModel(f"a GGUF array of {count} items")
            if item in FIXED:
                self.f.seek(FIXED[item] * count, 1)
            else:
                for _ in range(count):
                    self.value(item)
            return None
        if kind not in FIXED:
            raise BadModel(f"unknown GGUF metadata type {kind}")
        if kind in (4, 5, 10, 11):
            return self.take({4: "<I", 5: "<i", 10: "<Q", 11: "<q"}[kind])
        self.f.seek(FIXED[kind], 1)
        return None


def check_gguf(path: Path) -> Whole:
    size = path.stat().st_size
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise BadModel("does not start with the GGUF magic")
        r = _Reader(f)
        version = r.take("<I")
        if version not in (2, 3):
            raise BadModel(f"GGUF version {version}; this check reads versions 2 and 3")
        n_tensors, n_kv = r.take("<Q"), r.take("<Q")
        alignment = 32
        for _ in range(n_kv):
            key, kind = r.string(), r.take("<I")
            value = r.value(kind)
            if key == b"general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
        end: int | None = 0
        for _ in range(n_tensors):
            r.string()
            dims = [r.take("<Q") for _ in range(r.take("<I"))]
            kind, offset = r.take("<I"), r.take("<Q")
            elements = 1
            for d in dims:
                elements *= d
            if kind not in GGML_TYPES or end is None:
                end = None
                continue
            per_block, block_bytes = GGML_TYPES[kind]
            end = max(end, offset + -(-elements // per_block) * block_bytes)
        start = -(-f.tell() // alignment) * alignment
    return Whole(size, None if end is None else start + end, n_tensors)


def check(path: Path) -> Whole:
    """The file checked by its format (by suffix); raises BadModel, or OSError if unreadable."""
    if path.suffix == ".gguf":
        return check_gguf(path)
    if path.suffix == ".safetensors":
        return check_safetensors(path)
    raise BadModel("neither .gguf nor .safetensors")
