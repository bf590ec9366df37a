"""Creates the hosted engine of ``--backend trtllm|triton``; nothing here imports a GPU library."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from chatmesh.tokenizer import ChatTokenizer
from engine.backends.hosted import GenerationBackend, HostedEngine
from engine.backends.triton import TritonBackend
from engine.backends.trtllm import TrtllmBackend
from engine.config import EngineConfig
from engine.metrics import EngineMetrics
from engine.model.hf_loader import hf_llama_config, is_hf_dir

log = logging.getLogger(__name__)


def load_hosted_engine(
    config: EngineConfig, model_path: Path, tokenizer: ChatTokenizer, metrics: EngineMetrics | None = None
) -> HostedEngine:
    """Builds the backend and starts it; returns once it serves (TensorRT-LLM loads for minutes)."""
    if not is_hf_dir(model_path):
        raise ValueError(
            f"--backend {config.backend} needs --model to be a Hugging Face directory (config.json, "
            "safetensors, tokenizer.json); convert a GGUF with `python -m engine.model.convert_gguf_to_hf`"
        )
    spec = hf_llama_config(model_path).spec()
    tp = config.tensor_parallel_size
    backend: GenerationBackend
    if config.backend == "trtllm":
        backend = TrtllmBackend(
            model_path,
            tp,
            config.block_size,
            config.block_hash_seed,
            tokenizer.eos_token_ids,
            config.gpu_memory_fraction,
        )
    elif config.backend == "triton":
        backend = TritonBackend(
            config.triton_url,
            config.triton_model,
            config.block_size,
            tokenizer.eos_token_ids,
            tp,
            config.triton_timeout_s,
        )
    else:
        raise ValueError(f"{config.backend!r} is not a hosted backend")
    engine = HostedEngine(config, backend, tokenizer, spec, metrics)
    started = time.monotonic()
    engine.load()
    log.info("%s backend serving %s after %.1fs", config.backend, spec.name, time.monotonic() - started)
    return engine
