"""GGUF file → ``LlamaCheckpoint``. The file is memory-mapped; quantized tensors are not copied."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from chatmesh.tokenizer import _model_name as tokenizer_model_name
from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix


def load_gguf(path: str | Path) -> LlamaCheckpoint:
    reader = gguf.GGUFReader(str(path))
    fields = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.")}
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
    tensors = {t.name: t for t in reader.tensors}

    def matrix(name: str) -> WeightMatrix:
        tensor = tensors.get(name)
        if tensor is None:
            raise ValueError(f"{path}: tensor {name} is missing")
        in_features, out_features = (int(n) for n in tensor.shape)  # ggml order: [in, out]
        data = tensor.data
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = data.reshape(out_features, in_features)
        return WeightMatrix(name, tensor.tensor_type, (out_features, in_features), data)

    def vector(name: str) -> np.ndarray:
        return np.asarray(tensors[name].data, dtype=np.float32)

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
