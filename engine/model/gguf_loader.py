"""GGUF file → ``LlamaCheckpoint``. The file is memory-mapped; quantized tensors are not copied.

The header is read here rather than with ``gguf.GGUFReader``, which turns every one of the vocabulary's
~100k strings into numpy views and takes seconds (tens of seconds on a busy machine); this reader skips
the tokenizer arrays it does not need and takes milliseconds. The tokenizer itself lives in
chatmesh.tokenizer. Tensor payloads, types and dequantization are gguf's.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType as VT

from chatmesh.tokenizer import _model_name as tokenizer_model_name
from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix


def load_gguf(path: str | Path) -> LlamaCheckpoint:
    fields, tensors = read_gguf(path)
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only llama)")

    def meta(key: str, default: object = None) -> object:
        value = fields.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata llama.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))

    def matrix(name: str) -> WeightMatrix:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing")
        qtype, shape, data = tensors[name]
        return WeightMatrix(name, qtype, shape, data)

    def vector(name: str) -> np.ndarray:
        qtype, _, data = tensors[name]
        return gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(-1)

    embedding = matrix("token_embd.weight")
    config = LlamaConfig(
        name=_model_name(fields, path),
        num_layers=int(meta("block_count")),
        hidden_size=hidden,
        intermediate_size=int(meta("feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=int(meta("attention.head_count_kv", num_heads)),
        head_dim=int(meta("rope.dimension_count", hidden // num_heads)),
        vocab_size=embedding.shape[0],
        context_length=int(meta("context_length")),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon")),
    )
    if fields.get("llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling is not supported")
    layers = [
        LlamaLayer(
            attn_norm=vector(f"blk.{i}.attn_norm.weight"),
            wq=matrix(f"blk.{i}.attn_q.weight"),
            wk=matrix(f"blk.{i}.attn_k.weight"),
            wv=matrix(f"blk.{i}.attn_v.weight"),
            wo=matrix(f"blk.{i}.attn_output.weight"),
            ffn_norm=vector(f"blk.{i}.ffn_norm.weight"),
            w_gate=matrix(f"blk.{i}.ffn_gate.weight"),
            w_up=matrix(f"blk.{i}.ffn_up.weight"),
            w_down=matrix(f"blk.{i}.ffn_down.weight"),
        )
        for i in range(config.num_layers)
    ]
    lm_head = matrix("output.weight") if "output.weight" in tensors else embedding
    return LlamaCheckpoint(config, embedding, layers, vector("output_norm.weight"), lm_head)


def _model_name(fields: dict[str, object], path: str | Path) -> str:
    # The tokenizer's naming rule, so ModelSpec.name and ChatTokenizer.model_name always agree.
    return tokenizer_model_name(fields.get("general.basename"), fields.get("general.size_label"), path)


_SCALARS = {
    VT.UINT8: "<B",
    VT.INT8: "<b",
    VT.UINT16: "<H",
    VT.INT16: "<h",
    VT.UINT32: "<I",
    VT.INT32: "<i",
    VT.FLOAT32: "<f",
    VT.BOOL: "<?",
    VT.UINT64: "<Q",
    VT.INT64: "<q",
    VT.FLOAT64: "<d",
}

Tensor = tuple[gguf.GGMLQuantizationType, tuple[int, int], np.ndarray]


def read_gguf(path: str | Path) -> tuple[dict[str, object], dict[str, Tensor]]:
    """Metadata (string arrays skipped) and tensors of a GGUF v2/v3 file.

    A tensor is (type, (rows, row length), data): float32/float16 values ``[rows, row length]`` or raw
    quant blocks, uint8 ``[rows, bytes per row]``, both views of the memory-mapped file. A 1-D tensor is
    one row.
    """
    buf = np.memmap(path, mode="r")
    view = memoryview(buf)
    magic, version, n_tensors, n_kv = struct.unpack_from("<IIQQ", view, 0)
    if magic != gguf.GGUF_MAGIC or version < 2:
        raise ValueError(f"{path}: not a GGUF v2+ file")
    pos = 24

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", view, pos)
        pos += 8 + n
        return bytes(view[pos - n : pos]).decode("utf-8", errors="replace")

    def value(kind: VT) -> object:
        nonlocal pos
        if kind == VT.STRING:
            return string()
        if kind == VT.ARRAY:
            elem, count = struct.unpack_from("<IQ", view, pos)
            pos += 12
            if VT(elem) in _SCALARS:
                fmt = _SCALARS[VT(elem)]
                items = np.frombuffer(view, dtype=np.dtype(fmt), count=count, offset=pos)
                pos += items.nbytes
                return items.tolist()
            for _ in range(count):  # string (or nested) arrays: tokenizer data, skipped
                value(VT(elem))
            return None
        fmt = _SCALARS[kind]
        (v,) = struct.unpack_from(fmt, view, pos)
        pos += struct.calcsize(fmt)
        return v

    fields: dict[str, object] = {}
    for _ in range(n_kv):
        key = string()
        (kind,) = struct.unpack_from("<I", view, pos)
        pos += 4
        fields[key] = value(VT(kind))

    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", view, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", view, pos + 4)
        qtype, offset = struct.unpack_from("<IQ", view, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, gguf.GGMLQuantizationType(qtype), offset))

    alignment = int(fields.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT)
    data_start = -(-pos // alignment) * alignment
    tensors: dict[str, Tensor] = {}
    for name, dims, qtype, offset in infos:
        row_length, rows = (
            int(dims[0]),
            int(np.prod(dims[1:], dtype=np.int64)),
        )  # ggml: dims[0] varies fastest
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = row_length // block * block_bytes
        raw = buf[data_start + offset : data_start + offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            raw = raw.view(np.float16)
        tensors[name] = (qtype, (rows, row_length), raw)
    return fields, tensors
