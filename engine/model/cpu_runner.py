"""The CPU model runner: a LLaMA-family forward (LLaMA, Qwen2, Qwen3, Gemma 3) over the paged KV cache,
every sequence of a step in one batch.

Per step, the tokens of all chunks (prefill chunks and decode tokens alike) are flattened into one
``[T, hidden]`` activation, so each weight matrix is read once per step and applied with one GEMM.
Per layer: RMSNorm → one fused QKV GEMM → RoPE on q and k → K/V written into the cache slots of this
step → attention of each token over its own sequence's blocks → output GEMM → RMSNorm → one fused
gate|up GEMM → SwiGLU → down GEMM. Logits are computed only for rows that need them. The native kernels
run the whole layer stack in one C call (``layer_stack``, every architecture but Qwen2's q/k/v biases);
the numpy kernels, tensor-parallel ranks (which all-reduce between kernels) and Qwen2 run the same
sequence one kernel call at a time (``_run_layers``). Qwen2 adds the biases of q, k and v after the QKV
GEMM; Qwen3 RMS-normalizes each q and k head before RoPE; Gemma 3 adds, per layer: RMSNorm of each q and k head after the QKV GEMM, RMSNorm of
the attention and FFN outputs before their residual adds, GELU instead of SiLU, and on its local layers
a sliding window and their own RoPE base; its embeddings are scaled by sqrt(hidden).

KV cache: float16 arrays per layer (``KV_DTYPE``), indexed by the engine core's block ids on axis 0:
K ``[num_blocks, num_kv_heads, head_dim, block_size]`` (a block's keys transposed, so attention scores a
whole block with broadcast FMAs) and V ``[num_blocks, block_size, num_kv_heads, head_dim]``. float16, as
llama.cpp stores its cache, halves KV memory per token against float32: K/V are rounded to nearest once,
when written, and attention computes in float32. The rounding is per token, so it does not depend on the
batch or the chunking. block_size: at most 16, or a multiple of 16.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QType

from engine.model.checkpoint import LlamaCheckpoint, LlamaConfig, RopeTables, WeightMatrix, rope_tables
from engine.model.gguf_loader import load_gguf
from engine.model.kernels import Kernels, select_kernels
from engine.model.kernels.packing import as_q8_0
from engine.model.runner import SequenceChunk
from engine.model.step_batch import StepBatch, build_step_batch
from engine.model.tp.collective import Collective, SingleRank
from engine.model.tp.plan import RankShard, Span, plan_tensor_parallel
from engine.model.tp.shard import take_columns, take_rows

log = logging.getLogger(__name__)

KV_DTYPE = np.dtype(np.float16)


@dataclass(eq=False)
class _Layer:
    attn_norm: np.ndarray
    qkv: object  # packed [q | k | v] rows
    wo: object
    ffn_norm: np.ndarray
    gate_up: object  # packed [gate | up] rows
    down: object
    qkv_bias: np.ndarray | None = None  # Qwen2's, this rank's [q | k | v] share (see LlamaLayer)
    q_norm: np.ndarray | None = None  # Qwen3's and Gemma 3's (see LlamaLayer)
    k_norm: np.ndarray | None = None
    post_attn_norm: np.ndarray | None = None
    post_ffn_norm: np.ndarray | None = None


class CpuModelRunner:
    backend = "cpu"
    tensor_parallel_size = 1

    def __init__(
        self,
        checkpoint: LlamaCheckpoint,
        kernels: Kernels,
        shard: RankShard | None = None,
        collective: Collective | None = None,
    ) -> None:
        """``shard`` and ``collective``: this process is one rank of a tensor-parallel group (see
        ``engine.model.tp``) holding only its shard's weights and KV heads; default: the whole model."""
        self.config: LlamaConfig = checkpoint.config
        self.spec = self.config.spec()
        self.kernels = kernels
        shard = shard or plan_tensor_parallel(self.config, 1).shards[0]
        self._local = shard.local_config(self.config)  # the heads and FFN columns this rank computes
        self._collective = collective or SingleRank()
        self._vocab = shard.vocab
        pack = kernels.pack
        hd = self.config.head_dim
        q_rows, kv_rows = _scaled(shard.q_heads, hd), _scaled(shard.kv_heads, hd)
        ffn = shard.ffn_columns
        self._embedding = checkpoint.token_embedding
        self._layers = [
            _Layer(
                attn_norm=layer.attn_norm,
                qkv=pack(
                    _stack(
                        "qkv",
                        [
                            take_rows(layer.wq, q_rows),
                            take_rows(layer.wk, kv_rows),
                            take_rows(layer.wv, kv_rows),
                        ],
                    )
                ),
                wo=pack(take_columns(layer.wo, q_rows)),
                ffn_norm=layer.ffn_norm,
                gate_up=pack(_stack("gate_up", [take_rows(layer.w_gate, ffn), take_rows(layer.w_up, ffn)])),
                down=pack(take_columns(layer.w_down, ffn)),
                qkv_bias=_qkv_bias_share(layer.qkv_bias, self.config, q_rows, kv_rows),
                q_norm=layer.q_norm,
                k_norm=layer.k_norm,
                post_attn_norm=layer.post_attn_norm,
                post_ffn_norm=layer.post_ffn_norm,
            )
            for layer in checkpoint.layers
        ]
        self._output_norm = checkpoint.output_norm
        self._lm_head = pack(take_rows(checkpoint.lm_head, shard.vocab))
        # Per layer, its RoPE tables (one set per base: Gemma 3's local layers have their own).
        tables: dict[float, RopeTables] = {}
        for i in range(self.config.num_layers):
            theta = self.config.layer_rope_theta(i)
            if theta not in tables:
                tables[theta] = rope_tables(self.config, theta=theta)
        self._layer_ropes = [tables[self.config.layer_rope_theta(i)] for i in range(self.config.num_layers)]
        self._gated = kernels.gelu_mul if self.config.activation == "gelu_tanh" else kernels.silu_mul
        self._k_cache: list[np.ndarray] = []
        self._v_cache: list[np.ndarray] = []
        self._block_size = 0
        # Every layer in one kernel call, where the kernels offer it.
        self._layer_stack: Callable[[np.ndarray, StepBatch], None] | None = None

    @classmethod
    def from_gguf(
        cls, path: Path, num_threads: int | None = None, kernels: str | None = None
    ) -> CpuModelRunner:
        """Loads a GGUF LLaMA. ``kernels``: "native-int8" | "native" | "numpy" | "auto" (default
        $CHATMESH_ENGINE_KERNELS or auto); ``num_threads``: native kernel threads (default: the CPUs this
        process may use)."""
        started = time.monotonic()
        checkpoint = load_gguf(path)
        runner = cls(checkpoint, select_kernels(kernels, num_threads, checkpoint.config))
        log.info(
            "loaded %s from %s with %s kernels in %.1f s",
            runner.spec.name,
            path,
            runner.kernels.name,
            time.monotonic() - started,
        )
        return runner

    # -- ModelRunner ---------------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg = self._local
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * KV_DTYPE.itemsize

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self._local
        if block_size > 16 and block_size % 16:
            raise ValueError(f"block_size must be at most 16 or a multiple of 16, got {block_size}")
        k_shape = (num_blocks, cfg.num_kv_heads, cfg.head_dim, block_size)
        v_shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # np.zeros maps memory lazily (in 2 MiB huge pages where numpy gets them): the pool becomes
        # resident as blocks are first written, not at allocation.
        self._k_cache = [np.zeros(k_shape, dtype=KV_DTYPE) for _ in range(cfg.num_layers)]
        self._v_cache = [np.zeros(v_shape, dtype=KV_DTYPE) for _ in range(cfg.num_layers)]
        self._block_size = block_size
        # A tensor-parallel rank all-reduces between kernels, and the C stack adds no q/k/v bias: those
        # run the per-kernel loop.
        self._layer_stack = (
            self.kernels.layer_stack(self._layers, self._k_cache, self._v_cache, self._layer_ropes, cfg)
            if isinstance(self._collective, SingleRank)
            and all(layer.qkv_bias is None for layer in self._layers)
            else None
        )

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        logits = self.forward(self.step_batch(chunks))
        assert logits is not None, "the engine executes on rank 0, which gathers the logits"
        return logits

    def step_batch(self, chunks: Sequence[SequenceChunk]) -> StepBatch:
        if not self._k_cache:
            raise RuntimeError("allocate_kv_cache must be called before execute")
        return build_step_batch(chunks, self._block_size, self.config.context_length)

    def forward(self, batch: StepBatch) -> np.ndarray | None:
        """The step's logits (on a tensor-parallel rank other than 0: None, its share went to rank 0)."""
        cfg, ops = self._local, self.kernels
        x = self._embedding.dequantize_rows(batch.token_ids)
        if cfg.embedding_scale != 1.0:
            x *= np.float32(cfg.embedding_scale)
        if self._layer_stack:
            self._layer_stack(x, batch)
        else:
            self._run_layers(x, batch)
        assert x.dtype == np.float32, "float64 crept into the activations"
        if len(batch.logit_rows) == 0:
            return np.empty((0, cfg.vocab_size), dtype=np.float32)
        h = ops.rms_norm(np.ascontiguousarray(x[batch.logit_rows]), self._output_norm, cfg.rms_norm_eps)
        return self._collective.gather_logits(ops.linear(h, self._lm_head), self._vocab)

    def _run_layers(self, x: np.ndarray, batch: StepBatch) -> None:
        """Every decoder layer over x in place, one kernel call at a time."""
        cfg, ops, reduce = self._local, self.kernels, self._collective.all_reduce
        heads, kv_heads, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_width, kv_width = heads * hd, kv_heads * hd
        slot_block, slot_offset = np.divmod(batch.slots, self._block_size)
        eps = cfg.rms_norm_eps
        for i, (layer, k_cache, v_cache) in enumerate(
            zip(self._layers, self._k_cache, self._v_cache, strict=True)
        ):
            h = ops.rms_norm(x, layer.attn_norm, eps)
            qkv = ops.linear(h, layer.qkv)
            if layer.qkv_bias is not None:
                qkv += layer.qkv_bias
            if layer.q_norm is not None and layer.k_norm is not None:
                _norm_heads(ops, qkv, slice(0, q_width), layer.q_norm, eps, hd)
                _norm_heads(ops, qkv, slice(q_width, q_width + kv_width), layer.k_norm, eps, hd)
            ops.rope(qkv, batch.positions, self._layer_ropes[i], cfg)
            k_cache[slot_block, :, :, slot_offset] = qkv[:, q_width : q_width + kv_width].reshape(
                -1, kv_heads, hd
            )
            v_cache.reshape(-1, kv_width)[batch.slots] = qkv[:, q_width + kv_width :]
            attn = ops.attention(qkv, k_cache, v_cache, batch, cfg, window=self.config.window(i))
            x += _post_norm(ops, reduce(ops.linear(attn, layer.wo)), layer.post_attn_norm, eps)
            h = ops.rms_norm(x, layer.ffn_norm, eps)
            ffn = reduce(ops.linear(self._gated(ops.linear(h, layer.gate_up)), layer.down))
            x += _post_norm(ops, ffn, layer.post_ffn_norm, eps)

    def close(self) -> None:
        self._k_cache, self._v_cache, self._layer_stack = [], [], None


def _norm_heads(
    ops: Kernels, qkv: np.ndarray, columns: slice, weight: np.ndarray, eps: float, hd: int
) -> None:
    """RMSNorm of each head_dim-wide head in ``qkv[:, columns]``, in place."""
    heads = np.ascontiguousarray(qkv[:, columns]).reshape(-1, hd)
    qkv[:, columns] = ops.rms_norm(heads, weight, eps).reshape(len(qkv), -1)


def _post_norm(ops: Kernels, out: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    """A sublayer's output as its residual add takes it: RMSNorm-ed where the model has a post-norm."""
    return out if weight is None else ops.rms_norm(out, weight, eps)


def _qkv_bias_share(
    bias: np.ndarray | None, config: LlamaConfig, q_rows: Span, kv_rows: Span
) -> np.ndarray | None:
    """A rank's part of a [q | k | v] bias: its q heads', then its k and v heads'."""
    if bias is None:
        return None
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    k, v = bias[q_width : q_width + kv_width], bias[q_width + kv_width :]
    return np.concatenate([bias[q_rows.as_slice()], k[kv_rows.as_slice()], v[kv_rows.as_slice()]])


def _scaled(heads: Span, head_dim: int) -> Span:
    """Rows (or columns) of a range of heads."""
    return Span(heads.start * head_dim, heads.stop * head_dim)


def _stack(name: str, matrices: list[WeightMatrix]) -> WeightMatrix:
    """Rows of several [out_i, in] matrices as one [sum out_i, in] matrix, kept in their stored format
    when they share it (Q5_0 taken as the Q8_0 it equals), so one GEMM computes all of them."""
    matrices = [as_q8_0(m) for m in matrices]
    first = matrices[0]
    rows = sum(m.shape[0] for m in matrices)
    if all(m.qtype == first.qtype and m.data.ndim == 2 for m in matrices):
        return WeightMatrix(
            name, first.qtype, (rows, first.shape[1]), np.concatenate([m.data for m in matrices])
        )
    return WeightMatrix(
        name, QType.F32, (rows, first.shape[1]), np.concatenate([m.dequantize() for m in matrices])
    )
