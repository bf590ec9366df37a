"""Creates the hosted engine of ``--backend trtllm|triton``; nothing here imports a GPU library."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from chatmesh.model_files import hf_config, model_context_length
from chatmesh.tokenizer import ChatTokenizer, hf_model_name
from engine.backends.hosted import GenerationBackend, HostedEngine
from engine.backends.triton import TritonBackend
from engine.backends.trtllm import TrtllmBackend
from engine.config import EngineConfig
from engine.metrics import EngineMetrics
from engine.model.hf_loader import is_hf_dir
from engine.model.runner import ModelSpec

log = logging.getLogger(__name__)


def hosted_model_spec(model_path: Path) -> ModelSpec:
    """What our side needs of a hosted backend's model, from ``config.json`` alone: the served name
    (the router's pool, the orchestrator's tokenizer must agree) and the context window; the shape is
    only reported. The architecture is not checked here: TensorRT-LLM (or the Triton server) validates
    its own model, and refusing what our CPU loader cannot run would refuse models it serves."""
    config, text = hf_config(model_path)
    heads = int(text.get("num_attention_heads") or 0)
    return ModelSpec(
        name=hf_model_name(model_path, config),
        num_layers=int(text.get("num_hidden_layers") or 0),
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=int(text.get("head_dim") or (int(text.get("hidden_size") or 0) // heads if heads else 0)),
        vocab_size=int(text.get("vocab_size") or 0),
        context_length=model_context_length(model_path),
    )


def load_hosted_engine(
    config: EngineConfig, model_path: Path, tokenizer: ChatTokenizer, metrics: EngineMetrics | None = None
) -> HostedEngine:
    """Builds the backend and starts it; returns once it serves (TensorRT-LLM loads for minutes)."""
    if not is_hf_dir(model_path):
        raise ValueError(
            f"--backend {config.backend} needs --model to be a Hugging Face directory (config.json, "
            "safetensors, tokenizer.json); convert a GGUF with `python -m engine.model.convert_gguf_to_hf`"
        )
    spec = hosted_model_spec(model_path)
    backend: GenerationBackend
    if config.backend == "trtllm":
        backend = TrtllmBackend(
            model_path,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
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
            config.tensor_parallel_size,
            config.triton_timeout_s,
        )
    else:
        raise ValueError(f"{config.backend!r} is not a hosted backend")
    engine = HostedEngine(config, backend, tokenizer, spec, metrics)
    started = time.monotonic()
    engine.load()
    log.info("%s backend serving %s after %.1fs", config.backend, spec.name, time.monotonic() - started)
    return engine
