"""The CUDA model runner: the LLaMA forward of ``cpu_runner`` on torch tensors, over a paged KV cache on the GPU.

NOT RUN ON A GPU: this project's build machine has none. The module imports without torch (torch is
imported when the runner is created; ``--backend cuda`` without it fails with instructions).

Same engine core, same seam: the scheduler, KV block manager, prefix cache and KV events are ours and
unchanged; this class only does ``ModelRunner``'s arithmetic. Per step, every chunk's tokens (prefill
chunks and decode tokens alike) are flattened into one ``[T, hidden]`` activation (``build_step_batch``),
so each weight is read once per step: RMSNorm → fused QKV GEMM → interleaved RoPE (the GGUF layout of
``LlamaCheckpoint``) → K/V written to their slots → attention of each chunk over its own blocks
(gathered through the block table, one padded ``scaled_dot_product_attention`` for the whole step)
→ output GEMM → RMSNorm → fused gate|up GEMM → SwiGLU → down GEMM.

KV cache: per layer K and V of ``[num_blocks, block_size, kv_heads_per_rank, head_dim]`` in the model
dtype (bfloat16 by default), indexed by the engine core's block ids.

Tensor parallelism (``torchrun --nproc-per-node N python -m engine --backend cuda``) follows the CPU
engine's plan (``engine/model/tp/plan.py``): QKV and gate|up are column-parallel (each rank holds whole
GQA groups — its KV heads and their query heads — and a balanced share of FFN rows), the output and down
projections row-parallel followed by an NCCL all-reduce; embeddings, norms and the LM head are
replicated. Rank 0 runs the engine; it broadcasts each command (allocate, execute, close) to the other
ranks, which only compute.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from engine.model.checkpoint import LlamaCheckpoint, rope_tables
from engine.model.runner import SequenceChunk
from engine.model.step_batch import build_step_batch
from engine.model.tp.plan import Span, plan_tensor_parallel

log = logging.getLogger(__name__)


def import_torch():
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError(
            "the cuda backend needs PyTorch with CUDA: `pip install torch` on a GPU machine (see docs/gpu.md)"
        ) from exc
    return torch


def head_rows(heads: Span, head_dim: int) -> slice:
    """The rows of a Q/K/V projection (or columns of the attention output) that ``heads`` own."""
    return slice(heads.start * head_dim, heads.stop * head_dim)


class CudaModelRunner:
    backend = "cuda"

    def __init__(
        self,
        checkpoint: LlamaCheckpoint,
        device: str = "cuda",
        dtype: str = "bfloat16",
        rank: int = 0,
        world: int = 1,
    ) -> None:
        torch = self._torch = import_torch()
        cfg = self.config = checkpoint.config
        # The CPU engine's plan (whole GQA groups per rank, balanced FFN columns); the weights here are
        # dequantized, so any column is a valid cut.
        shard = plan_tensor_parallel(cfg, world, quant_block=1).shards[rank]
        q_rows, kv_rows = head_rows(shard.q_heads, cfg.head_dim), head_rows(shard.kv_heads, cfg.head_dim)
        ffn = shard.ffn_columns.as_slice()
        self.spec = cfg.spec()
        self.tensor_parallel_size = world
        self.rank, self.world = rank, world
        self.device = torch.device(device)
        self.dtype = getattr(torch, dtype)
        self.heads, self.kv_heads = shard.q_heads.size, shard.kv_heads.size

        def put(array: np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(self.device, self.dtype)

        def qkv(layer) -> np.ndarray:
            return np.concatenate(
                [
                    layer.wq.dequantize()[q_rows],
                    layer.wk.dequantize()[kv_rows],
                    layer.wv.dequantize()[kv_rows],
                ]
            )

        self._layers = [
            {
                "attn_norm": put(layer.attn_norm),
                "qkv": put(qkv(layer)),
                "wo": put(layer.wo.dequantize()[:, q_rows]),
                "ffn_norm": put(layer.ffn_norm),
                "gate_up": put(
                    np.concatenate([layer.w_gate.dequantize()[ffn], layer.w_up.dequantize()[ffn]])
                ),
                "down": put(layer.w_down.dequantize()[:, ffn]),
            }
            for layer in checkpoint.layers
        ]
        self._embedding = put(checkpoint.token_embedding.dequantize())
        self._lm_head = (
            self._embedding
            if checkpoint.lm_head is checkpoint.token_embedding
            else put(checkpoint.lm_head.dequantize())
        )
        self._output_norm = put(checkpoint.output_norm)
        tables = rope_tables(cfg)
        self._cos = torch.from_numpy(tables.cos).to(self.device)
        self._sin = torch.from_numpy(tables.sin).to(self.device)
        self._k_cache: list = []
        self._v_cache: list = []
        self._block_size = 0

    # -- ModelRunner (rank 0) --------------------------------------------------------------------------

    def kv_bytes_per_block(self, block_size: int) -> int:
        cfg, item = self.config, self._torch.finfo(self.dtype).bits // 8
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * item

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._broadcast(("allocate", num_blocks, block_size))
        self._allocate(num_blocks, block_size)

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        self._broadcast(("execute", list(chunks)))
        return self._forward(chunks)

    def close(self) -> None:
        self._broadcast(("close",))
        self._k_cache, self._v_cache = [], []

    # -- other ranks -----------------------------------------------------------------------------------

    def serve_worker(self) -> None:
        """Ranks > 0: do what rank 0 says until it closes."""
        while True:
            command = self._receive()
            if command[0] == "allocate":
                self._allocate(command[1], command[2])
            elif command[0] == "execute":
                self._forward(command[1])
            else:
                return

    def _broadcast(self, command: tuple) -> None:
        if self.world > 1:
            self._torch.distributed.broadcast_object_list([command], src=0)

    def _receive(self) -> tuple:
        box: list[Any] = [None]
        self._torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    # -- the forward -----------------------------------------------------------------------------------

    def _allocate(self, num_blocks: int, block_size: int) -> None:
        torch, cfg = self._torch, self.config
        shape = (num_blocks, block_size, self.kv_heads, cfg.head_dim)
        with torch.inference_mode():  # inference tensors: every step writes them in place
            self._k_cache = [self._zeros(shape) for _ in range(cfg.num_layers)]
            self._v_cache = [self._zeros(shape) for _ in range(cfg.num_layers)]
        self._block_size = block_size

    def _zeros(self, shape: tuple[int, ...]):
        return self._torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _forward(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        if not self._k_cache:
            raise RuntimeError("allocate_kv_cache must be called before execute")
        torch, cfg = self._torch, self.config
        batch = build_step_batch(chunks, self._block_size, cfg.context_length)
        dev = self.device
        token_ids = torch.from_numpy(batch.token_ids.astype(np.int64)).to(dev)
        positions = torch.from_numpy(batch.positions.astype(np.int64)).to(dev)
        slots = torch.from_numpy(batch.slots).to(dev)
        attention = _PagedAttention(
            torch, batch, self._block_size, self.heads, self.kv_heads, cfg.head_dim, dev
        )
        q_width, kv_width = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        eps = cfg.rms_norm_eps

        with torch.inference_mode():
            x = self._embedding[token_ids]
            for layer, k_cache, v_cache in zip(self._layers, self._k_cache, self._v_cache, strict=True):
                h = _rms_norm(torch, x, layer["attn_norm"], eps)
                qkv = torch.nn.functional.linear(h, layer["qkv"])
                q = self._rope(qkv[:, :q_width].reshape(-1, self.heads, cfg.head_dim), positions)
                k = self._rope(
                    qkv[:, q_width : q_width + kv_width].reshape(-1, self.kv_heads, cfg.head_dim), positions
                )
                v = qkv[:, q_width + kv_width :].reshape(-1, self.kv_heads, cfg.head_dim)
                k_cache.view(-1, self.kv_heads, cfg.head_dim)[slots] = k
                v_cache.view(-1, self.kv_heads, cfg.head_dim)[slots] = v
                attn = attention(q, k_cache, v_cache)
                x = x + self._all_reduce(torch.nn.functional.linear(attn, layer["wo"]))
                h = _rms_norm(torch, x, layer["ffn_norm"], eps)
                gate, up = torch.nn.functional.linear(h, layer["gate_up"]).chunk(2, dim=-1)
                x = x + self._all_reduce(
                    torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, layer["down"])
                )
            if len(batch.logit_rows) == 0:
                return np.empty((0, cfg.vocab_size), dtype=np.float32)
            rows = torch.from_numpy(batch.logit_rows).to(dev)
            h = _rms_norm(torch, x[rows], self._output_norm, eps)
            logits = torch.nn.functional.linear(h, self._lm_head).float()
        return logits.cpu().numpy()

    def _rope(self, x, positions):
        """Interleaved-pair rotation, as the reference: dims (2i, 2i+1) rotate by ``pos * freq_i``."""
        c = self._cos[positions][:, None, :].to(x.dtype)
        s = self._sin[positions][:, None, :].to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return self._torch.stack([even * c - odd * s, even * s + odd * c], dim=-1).flatten(-2)

    def _all_reduce(self, partial):
        if self.world > 1:
            self._torch.distributed.all_reduce(partial)
        return partial


class _PagedAttention:
    """Attention of each chunk's queries over its own sequence's cached K/V, for one step.

    The step's chunks are padded to ``[chunks, longest chunk]`` queries and ``[chunks, longest span]``
    keys gathered through the block tables, so the whole step is one ``scaled_dot_product_attention``
    call; a query at position p sees keys at positions <= p. The index tensors are built once per step
    and shared by all layers.
    """

    def __init__(
        self, torch, batch, block_size: int, heads: int, kv_heads: int, head_dim: int, device
    ) -> None:
        self.torch, self.heads, self.kv_heads, self.head_dim = torch, heads, kv_heads, head_dim
        num_chunks = len(batch.chunk_starts) - 1
        lengths = np.diff(batch.chunk_starts)
        self.max_q = int(lengths.max())
        # Row of each token inside its chunk's padded query block.
        self.token_seq = torch.from_numpy(batch.token_seq.astype(np.int64)).to(device)
        self.token_row = torch.from_numpy(
            np.arange(len(batch.token_ids)) - np.repeat(batch.chunk_starts[:-1], lengths)
        ).to(device)
        blocks = -(-batch.max_len // block_size)
        self.span = blocks * block_size
        self.block_tables = torch.from_numpy(batch.block_tables[:, :blocks].astype(np.int64)).to(device)
        q_pos = np.zeros((num_chunks, self.max_q), dtype=np.int64)  # padding rows see key 0 only
        q_pos[batch.token_seq, self.token_row.cpu().numpy()] = batch.positions
        key_pos = np.arange(self.span)
        self.mask = torch.from_numpy(key_pos[None, None, :] <= q_pos[:, :, None]).to(device)[:, None]

    def __call__(self, q, k_cache, v_cache):
        torch = self.torch
        num_chunks = self.block_tables.shape[0]
        q_pad = q.new_zeros((num_chunks, self.max_q, self.heads, self.head_dim))
        q_pad[self.token_seq, self.token_row] = q
        keys = k_cache[self.block_tables].reshape(num_chunks, self.span, self.kv_heads, self.head_dim)
        values = v_cache[self.block_tables].reshape(num_chunks, self.span, self.kv_heads, self.head_dim)
        # enable_gqa: query head j reads KV head j // (heads / kv_heads), as the reference's np.repeat
        # does, without materialising the repeated K/V.
        out = torch.nn.functional.scaled_dot_product_attention(
            q_pad.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=self.mask,
            enable_gqa=True,
        )
        return out.transpose(1, 2)[self.token_seq, self.token_row].reshape(len(q), -1)


def _rms_norm(torch, x, weight, eps: float):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def torchrun_world_size(tensor_parallel_size: int, environ: Mapping[str, str]) -> int:
    """The ranks torchrun started (``WORLD_SIZE``; 1 without torchrun), which must be the configured
    tensor-parallel size: the engine reports that size, and a chart or script that says 4 GPUs must not
    silently run on 1. Checked before torch is imported or a weight read."""
    world = int(environ.get("WORLD_SIZE", "1"))
    if world != tensor_parallel_size:
        raise ValueError(
            f"--backend cuda --tensor-parallel-size {tensor_parallel_size} runs one rank per GPU under "
            f"torchrun (torchrun --nproc-per-node {tensor_parallel_size} --module engine ...); this process "
            f"is one of {world} (WORLD_SIZE)"
        )
    return world


def create_cuda_runner(checkpoint: LlamaCheckpoint, dtype: str = "bfloat16") -> CudaModelRunner:
    """The rank-0 runner. Under ``torchrun`` (``WORLD_SIZE`` > 1) this joins the NCCL group; ranks > 0
    serve rank 0's commands here and exit when it closes — only rank 0 ever returns."""
    cfg = checkpoint.config
    if cfg.architecture != "llama" or cfg.layer_windows:
        what = "a sliding window" if cfg.architecture == "llama" else repr(cfg.architecture)
        raise ValueError(
            f"the cuda backend runs the llama architecture without a sliding window only, not {what}: "
            "serve this model on the cpu backend"
        )
    torch = import_torch()
    if not torch.cuda.is_available():
        raise RuntimeError("the cuda backend found no CUDA device (torch.cuda.is_available() is False)")
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if world > 1:
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group("nccl")
        log.info("cuda backend: rank %d of %d on GPU %d", rank, world, local_rank)
    runner = CudaModelRunner(checkpoint, f"cuda:{torch.cuda.current_device()}", dtype, rank, world)
    if rank != 0:
        runner.serve_worker()
        torch.distributed.destroy_process_group()
        raise SystemExit(0)
    return runner
