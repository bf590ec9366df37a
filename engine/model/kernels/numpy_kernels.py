"""The portable kernels: numpy and its BLAS, float32 weights. Correct on any CPU numpy supports.

Unlike the native kernels these are not batch-invariant: BLAS may sum in a different order for a
different number of rows, so a sequence's logits can move by float rounding with the batch around it.
"""

from __future__ import annotations

import numpy as np

from engine.model.checkpoint import LlamaConfig, RopeTables, WeightMatrix
from engine.model.step_batch import StepBatch


class NumpyKernels:
    name = "numpy"
    q8_activations = False

    def pack(self, matrix: WeightMatrix) -> np.ndarray:
        return matrix.dequantize().T  # [in, out] view: x @ w is a plain GEMM

    def linear(self, x: np.ndarray, packed: np.ndarray) -> np.ndarray:
        return x @ packed

    def layer_stack(self, layers, k_cache, v_cache, tables, config) -> None:
        return None  # the runner's per-kernel loop it is

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight

    def rope(self, qkv: np.ndarray, positions: np.ndarray, tables: RopeTables, config: LlamaConfig) -> None:
        heads, hd = config.num_heads + config.num_kv_heads, config.head_dim
        x = qkv[:, : heads * hd].reshape(len(qkv), heads, hd // 2, 2)
        c, s = tables.cos[positions][:, None, :], tables.sin[positions][:, None, :]
        even, odd = x[..., 0].copy(), x[..., 1].copy()
        x[..., 0] = even * c - odd * s
        x[..., 1] = even * s + odd * c

    def attention(
        self,
        qkv: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        batch: StepBatch,
        config: LlamaConfig,
        window: int = 0,
    ) -> np.ndarray:
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        group = num_heads // num_kv_heads
        block_size = v_cache.shape[1]
        scale = np.float32(1.0 / np.sqrt(head_dim))
        out = np.empty((batch.num_tokens, num_heads * head_dim), dtype=np.float32)
        for c in range(len(batch.chunk_starts) - 1):
            r0, r1 = int(batch.chunk_starts[c]), int(batch.chunk_starts[c + 1])
            positions = batch.positions[r0:r1]
            span = int(positions[-1]) + 1
            blocks = batch.block_tables[c, : -(-span // block_size)]
            keys = k_cache[blocks].transpose(0, 3, 1, 2).reshape(-1, num_kv_heads, head_dim)[:span]
            values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:span]
            keys, values = keys.astype(np.float32), values.astype(np.float32)  # float16 in the cache
            q = qkv[r0:r1, : num_heads * head_dim].reshape(r1 - r0, num_kv_heads, group, head_dim)
            scores = np.einsum("nkgd,lkd->kgnl", q, keys) * scale
            key_positions = np.arange(span)[None, :]
            hidden = key_positions > positions[:, None]
            if window:
                hidden |= key_positions <= positions[:, None] - window
            scores[..., hidden] = -np.inf
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            out[r0:r1] = np.einsum("kgnl,lkd->nkgd", probs, values).reshape(r1 - r0, -1)
        return out

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        gate, up = np.split(gate_up, 2, axis=-1)
        return gate / (np.float32(1.0) + np.exp(-gate)) * up

    def gelu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """GELU's tanh form as g * sigmoid(2u), u = sqrt(2/pi) (g + 0.044715 g^3)."""
        gate, up = np.split(gate_up, 2, axis=-1)
        z = np.float32(1.5957691216) * (gate + np.float32(0.044715) * gate * gate * gate)
        # e^-z capped where float32 would overflow (the native kernel's exp clamps alike): gelu(g) = 0 there
        return gate / (np.float32(1.0) + np.exp(np.minimum(-z, np.float32(88.0)))) * up
