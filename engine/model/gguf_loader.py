"""GGUF file → ``LlamaCheckpoint``. The file is memory-mapped; quantized tensors are not copied.

The header comes from ``chatmesh.gguf_header`` (milliseconds, where ``gguf.GGUFReader`` takes seconds);
the tokenizer lives in ``chatmesh.tokenizer``. Tensor payloads, types and dequantization are gguf's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from chatmesh.gguf_header import read_gguf_header
from chatmesh.tokenizer import model_name
from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix


def load_gguf(path: str | Path) -> LlamaCheckpoint:
    fields, tensors = read_gguf(path)
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r} is not supported (only llama)")
    # Positions rotated otherwise than by plain RoPE: the model would load and compute wrong logits.
    if fields.get("llama.rope.scaling.type") not in (None, "none"):
        raise ValueError(f"{path}: RoPE scaling {fields['llama.rope.scaling.type']!r} is not supported")
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            f"{path}: tensor rope_freqs.weight (RoPE frequency factors: Llama 3.1's rope scaling) is not "
            "supported"
        )

    def meta(key: str, default: Any = None) -> Any:
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
    return model_name(fields.get("general.basename"), fields.get("general.size_label"), path)


Tensor = tuple[gguf.GGMLQuantizationType, tuple[int, int], np.ndarray]


def read_gguf(path: str | Path) -> tuple[dict[str, object], dict[str, Tensor]]:
    """Metadata and tensors of a GGUF v2/v3 file.

    A tensor is (type, (rows, row length), data): float32/float16 values ``[rows, row length]`` or raw
    quant blocks, uint8 ``[rows, bytes per row]``, both views of the memory-mapped file. A 1-D tensor is
    one row.
    """
    header = read_gguf_header(path)
    buf = np.memmap(path, mode="r")
    tensors: dict[str, Tensor] = {}
    for info in header.tensors.values():
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        row_length, rows = int(info.dims[0]), int(np.prod(info.dims[1:], dtype=np.int64))
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        row_bytes = row_length // block * block_bytes
        raw = buf[info.offset : info.offset + rows * row_bytes].reshape(rows, row_bytes)
        if qtype == gguf.GGMLQuantizationType.F32:
            raw = raw.view(np.float32)
        elif qtype == gguf.GGMLQuantizationType.F16:
            raw = raw.view(np.float16)
        tensors[info.name] = (qtype, (rows, row_length), raw)
    return header.metadata, tensors
