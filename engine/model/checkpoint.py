"""A LLaMA-family checkpoint in memory, independent of the file format it came from.

Several architectures share these classes: LLaMA (Llama 3's RoPE frequency factors, Mistral's sliding
window), Qwen2, Qwen3 and Gemma 3, whose differences are optional fields (``None``, empty or their
LLaMA value otherwise): biases on q, k and v (Qwen2), per-head RMSNorm of q and k (Qwen3, Gemma 3),
embeddings scaled by sqrt(hidden), RMSNorm of the attention and FFN outputs before their residual adds,
a GELU-gated FFN, and sliding-window layers with their own RoPE base (Gemma 3).

Loaders (``gguf_loader`` today; a Hugging Face safetensors loader or a GPU backend's loader later) produce a
``LlamaCheckpoint``; runners consume it and pack the weights for their kernels. Weight matrices stay in
their stored (possibly quantized) form until a runner asks: ``WeightMatrix.dequantize()`` gives float32.

Conventions every loader must follow:
- matrices are ``[out_features, in_features]`` (one row per output);
- Q and K rows are in GGUF order, i.e. permuted for *interleaved-pair* RoPE (dims 2i and 2i+1 rotate
  together). A Hugging Face loader must apply llama.cpp's permutation to ``q_proj``/``k_proj`` rows;
  mixing layouts gives no error, only a model that answers nothing. A GGUF whose architecture rotates
  half-split pairs (i, i + head_dim/2; llama.cpp's NEOX: Gemma) has its Q and K rows (and q/k norm
  weights) reordered at load so that interleaved RoPE computes the same thing;
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
    architecture: str = "llama"  # GGUF's general.architecture: "llama" | "qwen2" | "qwen3" | "gemma3"
    embedding_scale: float = 1.0  # token embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    activation: str = "silu"  # of the gated FFN: "silu" | "gelu_tanh"
    # Per layer: how many positions (itself included) a token attends to; 0 or absent: all of them.
    layer_windows: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # RoPE base of the sliding-window layers, if not rope_theta
    # Per rotated pair, a divisor of its frequency (Llama 3's rope scaling, llama.cpp's rope_freqs); () or 1s:
    # plain RoPE.
    rope_freq_factors: tuple[float, ...] = ()

    def window(self, layer: int) -> int:
        return self.layer_windows[layer] if self.layer_windows else 0

    def layer_rope_theta(self, layer: int) -> float:
        if self.window(layer) and self.local_rope_theta is not None:
            return self.local_rope_theta
        return self.rope_theta

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
    # Gemma 3 only (float32, None for LLaMA): per-head RMSNorm weights of q and k [head_dim], and the
    # RMSNorm weights of the attention and FFN outputs [hidden].
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None
    # Qwen2 only: the biases of q, k and v, as one float32 [q | k | v] vector (q and k in the rows' order).
    qkv_bias: np.ndarray | None = None


@dataclass(eq=False)
class LlamaCheckpoint:
    config: LlamaConfig
    token_embedding: WeightMatrix  # [vocab, hidden]
    layers: list[LlamaLayer]
    output_norm: np.ndarray
    lm_head: WeightMatrix  # [vocab, hidden]; the embedding itself when tied


@dataclass(frozen=True)
class RopeTables:
    """cos and sin, float32 ``[positions, head_dim // 2]``, of angle ``pos * theta ** (-2i / head_dim) / f_i``
    (``f_i``: the config's frequency factors, 1 without them)."""

    cos: np.ndarray
    sin: np.ndarray


def rope_tables(config: LlamaConfig, length: int | None = None, theta: float | None = None) -> RopeTables:
    """Computed in float64 and rounded once, so every implementation that uses them rotates alike.
    ``theta``: the RoPE base (default: the config's global one)."""
    length = length or config.context_length
    inv_freq = (theta or config.rope_theta) ** (
        -np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim
    )
    if config.rope_freq_factors:
        inv_freq = inv_freq / np.asarray(config.rope_freq_factors, dtype=np.float64)
    angles = np.arange(length, dtype=np.float64)[:, None] * inv_freq[None, :]
    return RopeTables(np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32))
