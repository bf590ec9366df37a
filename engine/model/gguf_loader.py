"""GGUF file → ``LlamaCheckpoint``. The file is memory-mapped; quantized tensors are not copied.

The header comes from ``chatmesh.gguf_header`` (milliseconds, where ``gguf.GGUFReader`` takes seconds);
the tokenizer lives in ``chatmesh.tokenizer``. Tensor payloads, types and dequantization are gguf's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from chatmesh.gguf_header import read_gguf_header
from chatmesh.tokenizer import model_name
from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, LlamaLayer, WeightMatrix

# What llama.cpp's graph for an architecture fixes that its GGUF does not state.
GEMMA3_GLOBAL_EVERY = 6  # layers 5, 11, 17, ... attend to everything; the others to a sliding window
GEMMA3_LOCAL_ROPE_THETA = 10_000.0  # RoPE base of the sliding-window layers
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# Architectures whose RoPE rotates half-split pairs (llama.cpp's NEOX); the others rotate interleaved ones.
HALF_SPLIT_ROPE = ("qwen2", "qwen3", "gemma3")
# Tensor types whose dequantization the engine's packing is tested on (bit-equal to gguf's); a file with
# another is refused rather than run on an untested path.
SUPPORTED_TENSOR_TYPES = frozenset(
    gguf.GGMLQuantizationType[name] for name in ("F32", "F16", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q6_K")
)


def load_gguf(path: str | Path) -> LlamaCheckpoint:
    fields, tensors = read_gguf(path)
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: architecture {arch!r} is not supported (only {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    _refuse_unsupported_tensor_types(path, tensors)
    # Positions rotated otherwise than by plain RoPE: the model would load and compute wrong logits.
    if fields.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(
            f"{path}: RoPE scaling {fields[f'{arch}.rope.scaling.type']!r} is not supported (only Llama 3's "
            "frequency factors, rope_freqs.weight)"
        )
    if "rope_freqs.weight" in tensors and arch != "llama":
        # llama.cpp reads the factors for llama only; elsewhere what they mean is not defined.
        raise ValueError(f"{path}: tensor rope_freqs.weight on architecture {arch!r} is not supported")

    def meta(key: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(meta("embedding_length"))
    num_heads = int(meta("attention.head_count"))
    num_layers = int(meta("block_count"))

    def matrix(name: str) -> WeightMatrix:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing")
        qtype, shape, data = tensors[name]
        return WeightMatrix(name, qtype, shape, data)

    def vector(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name} is missing")
        qtype, _, data = tensors[name]
        return gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(-1)

    embedding = matrix("token_embd.weight")
    config = LlamaConfig(
        name=_model_name(fields, path),
        num_layers=num_layers,
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
    if arch == "gemma3":
        config = _gemma3_config(path, config, meta)
    else:
        config = _llama_like_config(path, config, arch, tensors, meta)
    # Half-split pairs (llama.cpp's NEOX RoPE): q/k rows are reordered to the interleaved pairs the
    # kernels rotate (see checkpoint.py).
    order = _interleaved_pair_order(config.head_dim) if arch in HALF_SPLIT_ROPE else None

    def head_rows(count: int) -> np.ndarray:
        """Rows of ``count`` heads in the order the kernels rotate them."""
        assert order is not None
        heads = count // config.head_dim
        return (np.arange(heads)[:, None] * config.head_dim + order[None, :]).reshape(-1)

    def rotated(name: str) -> WeightMatrix:
        m = matrix(name)
        if order is None:
            return m
        return WeightMatrix(m.name, m.qtype, m.shape, np.ascontiguousarray(m.data[head_rows(m.shape[0])]))

    def rotated_vector(name: str) -> np.ndarray:
        v = vector(name)
        return v if order is None else np.ascontiguousarray(v[head_rows(len(v))])

    # Qwen2's biases on q, k and v: all three or none (llama.cpp's graph adds each where present).
    biases = [f"blk.0.attn_{t}.bias" in tensors for t in "qkv"]
    if any(biases) and not all(biases):
        raise ValueError(f"{path}: biases on only some of attn_q, attn_k, attn_v are not supported")

    def layer(i: int) -> LlamaLayer:
        b = f"blk.{i}"
        extras: dict[str, np.ndarray] = {}
        if arch in ("gemma3", "qwen3"):
            extras |= {
                "q_norm": rotated_vector(f"{b}.attn_q_norm.weight"),
                "k_norm": rotated_vector(f"{b}.attn_k_norm.weight"),
            }
        if arch == "gemma3":
            extras |= {
                "post_attn_norm": vector(f"{b}.post_attention_norm.weight"),
                "post_ffn_norm": vector(f"{b}.post_ffw_norm.weight"),
            }
        if all(biases):
            extras["qkv_bias"] = np.concatenate(
                [
                    rotated_vector(f"{b}.attn_q.bias"),
                    rotated_vector(f"{b}.attn_k.bias"),
                    vector(f"{b}.attn_v.bias"),
                ]
            )
        return LlamaLayer(
            attn_norm=vector(f"{b}.attn_norm.weight"),
            wq=rotated(f"{b}.attn_q.weight"),
            wk=rotated(f"{b}.attn_k.weight"),
            wv=matrix(f"{b}.attn_v.weight"),
            wo=matrix(f"{b}.attn_output.weight"),
            ffn_norm=vector(f"{b}.ffn_norm.weight"),
            w_gate=matrix(f"{b}.ffn_gate.weight"),
            w_up=matrix(f"{b}.ffn_up.weight"),
            w_down=matrix(f"{b}.ffn_down.weight"),
            **extras,
        )

    layers = [layer(i) for i in range(config.num_layers)]
    lm_head = matrix("output.weight") if "output.weight" in tensors else embedding
    return LlamaCheckpoint(config, embedding, layers, vector("output_norm.weight"), lm_head)


def _gemma3_config(path: str | Path, config: LlamaConfig, meta: Any) -> LlamaConfig:
    """Gemma 3 as llama.cpp's graph computes it (src/models/gemma3.cpp and its hparams): head size from
    key_length, embeddings times sqrt(hidden), GELU(tanh), every sixth layer global (RoPE base from the
    file) and the others windowed (RoPE base 10,000), the RMSNorm weights used as stored (the converter
    folded Gemma's 1 + w into them), and no final logit soft-capping on this sliding-window variant."""
    head_dim = int(meta("attention.key_length"))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key and value head sizes differ, which the engine does not implement")
    if config.num_layers == 62:
        # llama.cpp scales 27B's queries by 1/sqrt(hidden/heads), not 1/sqrt(head_dim).
        raise ValueError(f"{path}: Gemma 3 27B (62 layers) scales its queries otherwise: not supported")
    window = int(meta("attention.sliding_window"))
    return replace(
        config,
        architecture="gemma3",
        head_dim=head_dim,
        embedding_scale=float(np.sqrt(np.float32(config.hidden_size), dtype=np.float32)),
        activation="gelu_tanh",
        layer_windows=tuple(
            0 if i % GEMMA3_GLOBAL_EVERY == GEMMA3_GLOBAL_EVERY - 1 else window
            for i in range(config.num_layers)
        ),
        local_rope_theta=GEMMA3_LOCAL_ROPE_THETA,
    )


def _llama_like_config(
    path: str | Path,
    config: LlamaConfig,
    arch: str,
    tensors: dict[str, Tensor],
    meta: Any,
) -> LlamaConfig:
    """LLaMA, Qwen2 and Qwen3 as llama.cpp's graphs compute them: Qwen3's head size from key_length
    (not hidden / heads), Llama 3's RoPE frequency factors, and on ``llama`` a Mistral-style sliding
    window on every layer."""
    head_dim = int(meta("attention.key_length", config.hidden_size // config.num_heads))
    if int(meta("attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key and value head sizes differ, which the engine does not implement")
    if int(meta("rope.dimension_count", head_dim)) != head_dim:
        raise ValueError(f"{path}: RoPE on part of each head (rope.dimension_count) is not supported")
    factors: tuple[float, ...] = ()
    if "rope_freqs.weight" in tensors:
        qtype, _, data = tensors["rope_freqs.weight"]
        values = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(-1)
        if len(values) != head_dim // 2:
            raise ValueError(f"{path}: rope_freqs.weight has {len(values)} factors, not head_dim / 2")
        factors = tuple(float(v) for v in values)
    window = int(meta("attention.sliding_window", 0))
    if window and window < config.context_length and arch != "llama":
        # llama.cpp's qwen2/qwen3 graphs ignore the key: a file that means it would be computed wrongly.
        raise ValueError(f"{path}: {arch}.attention.sliding_window ({window}) is not supported on {arch!r}")
    return replace(
        config,
        architecture=arch,
        head_dim=head_dim,
        rope_freq_factors=factors,
        # Mistral's window: every layer. llama.cpp ignores this key on `llama` (docs/models.md).
        layer_windows=(window,) * config.num_layers if window and arch == "llama" else (),
    )


def _refuse_unsupported_tensor_types(path: str | Path, tensors: dict[str, Tensor]) -> None:
    for name, (qtype, _, _) in tensors.items():
        if qtype not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise ValueError(
                f"{path}: tensor {name} is of type {qtype.name}, which the engine does not run "
                f"(only {supported})"
            )


def _interleaved_pair_order(head_dim: int) -> np.ndarray:
    """Rows of a head such that pair (2i, 2i+1) holds what half-split RoPE rotates together (i, i + d/2)."""
    half = head_dim // 2
    return np.stack([np.arange(half), np.arange(half) + half], axis=1).reshape(-1)


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
