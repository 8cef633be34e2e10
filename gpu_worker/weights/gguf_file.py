"""A GGUF file's header: its metadata and where each tensor lies, read without the ``gguf`` package.

``gguf.GGUFReader`` builds numpy views of every metadata field, a tokenizer's 128k strings and 280k
merges included, which takes seconds even for the embedded model's 49k-token vocabulary
(docs/benchmarks-history.md). This reader walks the header once with ``struct`` and keeps string arrays (the
vocabulary, the merges) only where asked, their count otherwise, so a start reads a Llama 3 header
quickly and needs no cache. The layout (GGUF v2/v3, little-endian): magic, version, tensor count,
metadata count; each metadata key, value type and value; each tensor's name, dimensions (innermost
first), ggml type and offset into the data section, which starts at the next ``general.alignment``
boundary.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Container
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# Fixed-width metadata value types: uint8/int8/bool, uint16/int16, uint32/int32/float32, uint64/int64/float64.
_SCALAR = {0: "B", 1: "b", 7: "?", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_VERSIONS = (2, 3)
# The string arrays a config and a tokenizer read; any other is left as its count.
TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


class GgufFormatError(ValueError):
    """The file is not a GGUF this reader understands."""


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor of a GGUF lies."""

    name: str
    type: int  # ggml type id
    shape: tuple[int, ...]  # ggml order: the innermost (input) dimension first
    offset: int  # bytes from the file's start
    nbytes: int


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF's metadata (key -> value; string arrays not asked for as their length) and tensors."""

    path: Path
    metadata: dict[str, Any]
    tensors: tuple[TensorEntry, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    def tensor(self, name: str) -> TensorEntry | None:
        return next((t for t in self.tensors if t.name == name), None)

    def read_floats(self, name: str) -> list[float] | None:
        """A small F32 tensor's values (rope factors), or None where the file has no such tensor."""
        entry = self.tensor(name)
        if entry is None:
            return None
        if entry.type != 0:
            raise GgufFormatError(f"{self.path}: {name} is ggml type {entry.type}, not F32")
        with open(self.path, "rb") as f:
            f.seek(entry.offset)
            return [float(v) for v in np.frombuffer(f.read(entry.nbytes), dtype=np.float32)]


def read_header(path: Path, string_arrays: Container[str] = ()) -> GgufHeader:
    """Parse ``path``'s header (the file is mapped, its tensor data never touched)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
        return _parse(path, blob, string_arrays)


def _parse(path: Path, blob: mmap.mmap, string_arrays: Container[str]) -> GgufHeader:
    if blob[:4] != b"GGUF":
        raise GgufFormatError(f"{path} is not a GGUF file (no GGUF magic)")
    version, tensor_count, kv_count = struct.unpack_from("<IQQ", blob, 4)
    if version not in _VERSIONS:
        raise GgufFormatError(f"{path} is GGUF v{version}; rivulet reads v2 and v3")
    pos, metadata = 24, {}
    for _ in range(kv_count):
        key, pos = _string(blob, pos)
        (value_type,) = struct.unpack_from("<I", blob, pos)
        metadata[key], pos = _value(blob, pos + 4, value_type, key in string_arrays)
    if "general.architecture" not in metadata:
        raise GgufFormatError(f"{path} names no general.architecture")
    raw = []
    for _ in range(tensor_count):
        name, pos = _string(blob, pos)
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 4 + 8 * dims + 12
        raw.append((name, int(ggml_type), tuple(int(d) for d in shape), int(offset)))
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = tuple(
        TensorEntry(name, ggml_type, shape, data_start + offset, _nbytes(ggml_type, shape, path))
        for name, ggml_type, shape, offset in raw
    )
    for t in tensors:
        if t.offset + t.nbytes > len(blob):
            raise GgufFormatError(f"{path}: tensor {t.name} runs past the end of the file (truncated?)")
    return GgufHeader(path=path, metadata=metadata, tensors=tensors)


def _nbytes(ggml_type: int, shape: tuple[int, ...], path: Path) -> int:
    import gguf

    try:
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError) as exc:
        raise GgufFormatError(f"{path}: ggml type {ggml_type} is unknown to the gguf package") from exc
    return int(np.prod(shape, dtype=np.int64)) // block * block_bytes


def _string(blob: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", blob, pos)
    return blob[pos + 8 : pos + 8 + length].decode("utf-8", errors="replace"), pos + 8 + length


def _value(blob: mmap.mmap, pos: int, value_type: int, keep_strings: bool) -> tuple[Any, int]:
    if value_type in _SCALAR:
        fmt = "<" + _SCALAR[value_type]
        return struct.unpack_from(fmt, blob, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _string(blob, pos)
    if value_type != _ARRAY:
        raise GgufFormatError(f"metadata value type {value_type} is not GGUF's")
    element_type, count = struct.unpack_from("<IQ", blob, pos)
    pos += 12
    if element_type in _SCALAR:  # token types, scores, per-layer counts: one unpack
        fmt = f"<{count}{_SCALAR[element_type]}"
        return list(struct.unpack_from(fmt, blob, pos)), pos + struct.calcsize(fmt)
    if element_type != _STRING:
        raise GgufFormatError(f"metadata arrays of type {element_type} are not read")
    values: list[str] = []
    for _ in range(count):
        if keep_strings:
            value, pos = _string(blob, pos)
            values.append(value)
        else:
            (length,) = struct.unpack_from("<Q", blob, pos)
            pos += 8 + length
    return (values if keep_strings else count), pos
