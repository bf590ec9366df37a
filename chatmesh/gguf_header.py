"""Reads the header of a GGUF file: its key/value metadata and its tensor directory, nothing else.

``gguf.GGUFReader`` wraps every element of every array in numpy views, which takes ~5 s (tens of seconds
on a busy machine) for SmolLM2's 49k-token vocabulary. Every engine and orchestrator process needs the
metadata (tokenizer, chat template, architecture) and the engine needs where each tensor lies; this reads
both in ~0.1 s. Tensor payloads, quantization types and dequantization stay with the ``gguf`` package.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> struct format (scalars), per the GGUF specification.
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # ggml order: dims[0] varies fastest
    ggml_type: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the tensor's data in the file


@dataclass(frozen=True)
class GgufHeader:
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF (v2 or v3) file, as plain Python values."""
    with open(path, "rb") as f:
        return _read_metadata(f, path)[0]


def read_gguf_header(path: str | Path) -> GgufHeader:
    """Metadata and the tensor directory (with absolute data offsets) of a GGUF file."""
    with open(path, "rb") as f:
        metadata, tensor_count = _read_metadata(f, path)
        infos = []
        for _ in range(tensor_count):
            name = _read_string(f)
            (n_dims,) = struct.unpack("<I", f.read(4))
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            ggml_type, offset = struct.unpack("<IQ", f.read(12))
            infos.append((name, dims, ggml_type, offset))
        alignment = int(metadata.get("general.alignment") or DEFAULT_ALIGNMENT)
        data_start = -(-f.tell() // alignment) * alignment
    tensors = {name: TensorInfo(name, dims, t, data_start + offset) for name, dims, t, offset in infos}
    return GgufHeader(metadata=metadata, tensors=tensors)


def _read_metadata(f: BinaryIO, path: str | Path) -> tuple[dict[str, Any], int]:
    """The metadata and the number of tensors, leaving ``f`` at the start of the tensor directory."""
    if f.read(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    (version,) = struct.unpack("<I", f.read(4))
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
    tensor_count, kv_count = struct.unpack("<QQ", f.read(16))
    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        key = _read_string(f)
        (value_type,) = struct.unpack("<I", f.read(4))
        metadata[key] = _read_value(f, value_type)
    return metadata, tensor_count


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", f.read(8))
    return f.read(length).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, value_type: int) -> Any:
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type == _STRING:
            return [_read_string(f) for _ in range(count)]
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(struct.calcsize(fmt) * count)))
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    raise ValueError(f"unknown GGUF value type {value_type}")
