"""Builds an embedding engine from a sentence-encoder directory: weights, kernels, tokenizer, batcher."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.embeddings.batcher import EmbeddingBatcher
from engine.embeddings.service import EmbeddingService
from engine.embeddings.tokenizer import EmbeddingTokenizer
from engine.metrics import EngineMetrics
from engine.model.bert import BertEncoder, load_bert
from engine.model.kernels import select_kernels
from engine.model.kernels.blas import limit_blas_threads

log = logging.getLogger(__name__)


def load_embedding_service(
    config: EngineConfig, model_dir: Path, metrics: EngineMetrics | None = None
) -> EmbeddingService:
    """The service of ``model_dir`` on the running loop (not started). Only the cpu backend computes
    embeddings; the batch budget is ``--max-batched-tokens`` (at least one input of the model's longest),
    the queue bound ``--max-waiting-requests`` calls."""
    if config.backend != "cpu":
        raise ValueError(f"embedding models run on the cpu backend only, not --backend {config.backend}")
    if config.tensor_parallel_size != 1:
        raise ValueError("embedding models run without tensor parallelism (--tensor-parallel-size 1)")
    started = time.monotonic()
    checkpoint = load_bert(model_dir)
    encoder = BertEncoder(checkpoint, select_kernels(None, config.num_threads or None))
    if encoder.kernels.name != "numpy":  # the native kernels own the cores (engine/model/kernels/blas.py)
        limit_blas_threads(1)
    tokenizer = EmbeddingTokenizer(model_dir, checkpoint.config.max_tokens)
    batcher = EmbeddingBatcher(
        encoder,
        asyncio.get_running_loop(),
        config.max_batched_tokens,
        config.max_waiting_requests,
        on_batch=metrics.observe_embed_batch if metrics is not None else None,
    )
    log.info(
        "embedding model %s loaded in %.1fs (%d dimensions, %d tokens at most, %s kernels)",
        checkpoint.config.name,
        time.monotonic() - started,
        checkpoint.config.hidden_size,
        checkpoint.config.max_tokens,
        encoder.kernels.name,
    )
    return EmbeddingService(config, model_dir, tokenizer, batcher)
