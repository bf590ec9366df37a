"""A LLaMA checkpoint in memory, independent of the file format it came from.

Loaders (``gguf_loader`` today; a Hugging Face safetensors loader or a GPU backend's loader later) produce a
``LlamaCheckpoint``; runners consume it and pack the weights for their kernels. Weight matrices stay in
their stored (possibly quantized) form until a runner asks: ``WeightMatrix.dequantize()`` gives float32.

Conventions every loader must follow:
- matrices are ``[out_features, in_features]`` (one row per output);
- Q and K rows are in GGUF order, i.e. permuted for *interleaved-pair* RoPE (dims 2i and 2i+1 rotate
  together). A Hugging Face loader must apply llama.cpp's permutation to ``q_proj``/``k_proj`` rows;
  mixing layouts gives no error, only a model that answers nothing;
- the LM head is its own matrix even when tied (then it is the embedding matrix object itself).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import gguf
import numpy as np

from engine.model.runner import ModelSpec


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    rope_theta: float
    rms_norm_eps: float

    def spec(self) -> ModelSpec:
        return ModelSpec(
            name=self.name,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            context_length=self.context_length,
        )


@dataclass(eq=False)
class WeightMatrix:
    """One ``[out, in]`` matrix as stored: ``data`` is float32/float16 values, or the raw GGML quant blocks
    (uint8 ``[out, bytes_per_row]``) when ``qtype`` is a quantized type."""

    name: str
    qtype: gguf.GGMLQuantizationType
    shape: tuple[int, int]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """float32 ``[out, in]``; cached, since the reference and the numpy runner share it."""
        return _dequantized(self)

    def dequantize_rows(self, rows: np.ndarray) -> np.ndarray:
        """float32 ``[len(rows), in]`` of selected rows only (embedding lookups)."""
        return gguf.quants.dequantize(self.data[rows], self.qtype).reshape(len(rows), self.shape[1])


@functools.cache
def _dequantized(matrix: WeightMatrix) -> np.ndarray:
    out = gguf.quants.dequantize(matrix.data, matrix.qtype).reshape(matrix.shape)
    return np.ascontiguousarray(out, dtype=np.float32)


@dataclass(eq=False)
class LlamaLayer:
    attn_norm: np.ndarray  # float32 [hidden]
    wq: WeightMatrix
    wk: WeightMatrix
    wv: WeightMatrix
    wo: WeightMatrix
    ffn_norm: np.ndarray
    w_gate: WeightMatrix
    w_up: WeightMatrix
    w_down: WeightMatrix


@dataclass(eq=False)
class LlamaCheckpoint:
    config: LlamaConfig
    token_embedding: WeightMatrix  # [vocab, hidden]
    layers: list[LlamaLayer]
    output_norm: np.ndarray
    lm_head: WeightMatrix  # [vocab, hidden]; the embedding itself when tied


@dataclass(frozen=True)
class RopeTables:
    """cos and sin, float32 ``[positions, head_dim // 2]``, of angle ``pos * theta ** (-2i / head_dim)``."""

    cos: np.ndarray
    sin: np.ndarray


def rope_tables(config: LlamaConfig, length: int | None = None) -> RopeTables:
    """Computed in float64 and rounded once, so every implementation that uses them rotates alike."""
    length = length or config.context_length
    inv_freq = config.rope_theta ** (-np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return RopeTables(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
