"""The plain LLaMA forward: float32 numpy, no KV cache, no batching, no paging.

It recomputes the whole prefix for every call, so it is slow by design; it exists to be obviously right.
Tests hold every runner (any kernels, any batch mix, any chunking, any block layout) to it.
Two options model a runner's deliberate roundings, so that the comparison measures its arithmetic:
``kv_dtype``, the precision it stores K/V in (the CPU runner: float16), and ``q8_activations``: the input
of every quantized matrix is rounded to Q8 blocks first (``tests.engine.q8_activations``), as the CPU
runner's int8 GEMM (and llama.cpp) does. The defaults are the plain float32 forward.
"""

from __future__ import annotations

import numpy as np

from engine.model.checkpoint import LlamaCheckpoint, RopeTables, WeightMatrix, rope_tables
from tests.engine.q8_activations import round_input


class ReferenceModel:
    def __init__(
        self, checkpoint: LlamaCheckpoint, kv_dtype: np.dtype = np.float32, q8_activations: bool = False
    ) -> None:
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.kv_dtype = np.dtype(kv_dtype)
        self.q8_activations = q8_activations

    def logits(self, token_ids: list[int] | np.ndarray) -> np.ndarray:
        """float32 ``[len(token_ids), vocab]``: next-token logits after every prefix of ``token_ids``."""
        cfg, ckpt = self.config, self.checkpoint
        n = len(token_ids)
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tables = rope_tables(cfg, n)
        causal = np.triu(np.full((n, n), -np.inf, dtype=np.float32), k=1)
        scale = np.float32(1.0 / np.sqrt(hd))

        x = ckpt.token_embedding.dequantize_rows(np.asarray(token_ids))
        for layer in ckpt.layers:
            h = _rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            q = _rope(self._linear(h, layer.wq).reshape(n, heads, hd), tables)
            k = _rope(self._linear(h, layer.wk).reshape(n, kv_heads, hd), tables)
            v = self._linear(h, layer.wv).reshape(n, kv_heads, hd)
            k, v = (a.astype(self.kv_dtype).astype(np.float32) for a in (k, v))
            group = heads // kv_heads
            k = np.repeat(k, group, axis=1)  # query head j reads kv head j // group
            v = np.repeat(v, group, axis=1)
            scores = np.einsum("qhd,khd->hqk", q, k) * scale + causal
            probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
            probs /= probs.sum(axis=-1, keepdims=True)
            attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd)
            x = x + self._linear(attn, layer.wo)
            h = _rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps)
            gate = self._linear(h, layer.w_gate)
            up = self._linear(h, layer.w_up)
            x = x + self._linear(gate / (1.0 + np.exp(-gate)) * up, layer.w_down)
            assert x.dtype == np.float32, "float64 crept into the activations"
        x = _rms_norm(x, ckpt.output_norm, cfg.rms_norm_eps)
        return self._linear(x, ckpt.lm_head)

    def _linear(self, x: np.ndarray, matrix: WeightMatrix) -> np.ndarray:
        if self.q8_activations:
            x = round_input(x, matrix.qtype)
        return x @ matrix.dequantize().T

    def greedy(self, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
        """Greedy continuation of ``prompt`` (at most ``max_new_tokens``, ending early at a stop id)."""
        tokens = list(prompt)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(np.argmax(self.logits(tokens)[-1]))
            out.append(token)
            tokens.append(token)
            if token in stop_ids:
                break
        return out


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * weight


def _rope(x: np.ndarray, tables: RopeTables) -> np.ndarray:
    """Interleaved-pair rotation (GGUF layout): dims (2i, 2i+1) rotate by angle ``pos * freq_i``."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = tables.cos[:, None, :], tables.sin[:, None, :]
    out = np.empty_like(x)
    out[..., 0::2] = even * c - odd * s
    out[..., 1::2] = even * s + odd * c
    return out
