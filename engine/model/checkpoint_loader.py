"""Reads a checkpoint from a path, whichever format it is in: a GGUF file or a Hugging Face directory.

Runners that load their own weights (the tensor-parallel ranks) and ``loading.create_runner`` both call
this, so it sits below both (``loading`` imports the runners, never the other way round).
"""

from __future__ import annotations

from pathlib import Path

from engine.model.checkpoint import LlamaCheckpoint
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import is_hf_dir, load_hf_dir


def load_checkpoint(model_path: Path) -> LlamaCheckpoint:
    """A GGUF file, or a Hugging Face directory (config.json + safetensors)."""
    if is_hf_dir(model_path):
        return load_hf_dir(model_path)
    if model_path.is_dir():
        raise ValueError(f"{model_path} is a directory without config.json: not a Hugging Face model")
    return load_gguf(model_path)
