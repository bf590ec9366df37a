"""Creates the model runner of a backend. Nothing above this module knows which backend it talks to.

A new backend (a Hugging Face directory, a GPU runner, tensor parallelism) is one more branch here and
one class implementing ``engine.model.runner.ModelRunner``; scheduler and KV cache stay untouched.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from chatmesh.tokenizer import ChatTokenizer
from engine.model.checkpoint_loader import load_checkpoint
from engine.model.null_runner import NullModelRunner
from engine.model.runner import ModelRunner, ModelSpec

log = logging.getLogger(__name__)

# The null backend computes nothing, so it has no context limit of its own; it advertises this one.
NULL_CONTEXT_LENGTH = 8192
# What null-backend streams say, over and over.
NULL_TEXT = (
    " The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single"
    " step. All that glitters is not gold, and every cloud has a silver lining."
)


def create_runner(
    backend: str,
    model_path: Path,
    tokenizer: ChatTokenizer,
    num_threads: int | None = None,
    null_tokens_per_s: float = 0.0,
    tensor_parallel_size: int = 1,
    null_text: str = "",
) -> ModelRunner:
    """The runner for ``backend`` serving ``model_path`` (whose tokenizer is ``tokenizer``).
    ``num_threads``: compute threads per rank (default: this process's CPUs shared among the ranks)."""
    if backend == "cpu" and tensor_parallel_size > 1:
        from engine.model.tp.runner import TensorParallelRunner

        threads = num_threads or max(1, len(os.sched_getaffinity(0)) // tensor_parallel_size)
        log.info("loading %s over %d tensor-parallel ranks", model_path, tensor_parallel_size)
        return TensorParallelRunner(model_path, tensor_parallel_size, threads)
    if backend == "cpu":
        try:
            from engine.model.cpu_runner import CpuModelRunner
            from engine.model.kernels import select_kernels
        except ModuleNotFoundError as exc:
            if exc.name != "engine.model.cpu_runner":
                raise
            raise RuntimeError(
                "the cpu backend is not part of this build (engine/model/cpu_runner.py is missing); "
                "use --backend null to run without a model"
            ) from exc
        log.info("loading %s on the cpu backend", model_path)
        checkpoint = load_checkpoint(model_path)
        return CpuModelRunner(checkpoint, select_kernels(None, num_threads, checkpoint.config))
    if backend == "cuda":
        from engine.model.cuda_runner import create_cuda_runner, import_torch, torchrun_world_size

        torchrun_world_size(tensor_parallel_size, os.environ)
        import_torch()  # fails with instructions before the weights are read
        log.info("loading %s on the cuda backend", model_path)
        return create_cuda_runner(load_checkpoint(model_path))
    if backend == "null":
        log.info("null backend: no model computed; tokens are paced at %.0f/s per stream", null_tokens_per_s)
        spec = ModelSpec(
            name=tokenizer.model_name,
            num_layers=0,
            num_kv_heads=0,
            head_dim=0,
            vocab_size=tokenizer.vocab_size,
            context_length=NULL_CONTEXT_LENGTH,
        )
        return NullModelRunner(spec, tokenizer.encode(null_text or NULL_TEXT), null_tokens_per_s)
    raise ValueError(f"unknown backend {backend!r}: expected cpu, cuda or null")
