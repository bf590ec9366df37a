"""Reads the key/value metadata at the head of a GGUF file, and nothing else.

``gguf.GGUFReader`` indexes every tensor and wraps every array element, which takes ~5 s for
SmolLM2's 49k-token vocabulary; every engine and orchestrator process needs only the metadata
(tokenizer, chat template, architecture), which this reads in ~0.1 s. Tensor data stays with the
``gguf`` package (the engine's weight loader).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"

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


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values of a GGUF (v2 or v3) file, as plain Python values."""
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        (version,) = struct.unpack("<I", f.read(4))
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        _tensor_count, kv_count = struct.unpack("<QQ", f.read(16))
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = _read_string(f)
            (value_type,) = struct.unpack("<I", f.read(4))
            metadata[key] = _read_value(f, value_type)
        return metadata


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
            size = struct.calcsize(fmt)
            return list(struct.unpack(f"<{count}{fmt[1]}", f.read(size * count)))
        return [_read_value(f, item_type) for _ in range(count)]
    if value_type in _SCALARS:
        fmt = _SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    raise ValueError(f"unknown GGUF value type {value_type}")
