"""Models whose tokenizer or positions chatmesh does not implement are refused at start, naming what is
unsupported, rather than loaded to split text into wrong ids or compute wrong logits without an error
(issue 54, item 0): a GGUF with another pre-tokenizer than SmolLM's or another tokenizer model, a GGUF
carrying Llama 3.1's RoPE frequency factors (``rope_freqs.weight``), and the same in a Hugging Face
directory (a ``tokenizer.json`` normalizer or BPE option, ``rope_scaling`` in ``config.json``). The
engine and the orchestrator each exit with the message, without a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from chatmesh.tokenizer import ChatTokenizer, load_tokenizer
from engine.model.gguf_loader import load_gguf
from engine.model.hf_loader import read_hf_config
from meshkit.launcher import free_port
from tests.fixtures.engines import ROOT
from tests.fixtures.gguf_files import REMOVED, bundled_metadata, tiny_llama, tiny_llama_metadata, write_gguf
from tests.fixtures.identity import session_keys

# A process that refuses its model exits well within this (it loads no weights).
START_TIMEOUT_S = 30.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"tokenizer.ggml.pre": "llama-bpe"}, "'llama-bpe'"),
        ({"tokenizer.ggml.pre": REMOVED}, "tokenizer.ggml.pre"),
        ({"tokenizer.ggml.model": "llama"}, "'llama'"),
    ],
)
def test_a_gguf_tokenizer_other_than_smollms_is_refused_naming_it(tmp_path: Path, change, named) -> None:
    path = write_gguf(tmp_path / "model.gguf", bundled_metadata(change))
    with pytest.raises(ValueError) as refused:
        ChatTokenizer.from_gguf(path)
    [key] = change
    assert key in str(refused.value) and named in str(refused.value)


def test_a_gguf_with_smollms_tokenizer_loads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf", bundled_metadata())
    assert ChatTokenizer.from_gguf(path).fingerprint == load_tokenizer().fingerprint


def test_a_gguf_with_rope_frequency_factors_is_refused(tmp_path: Path) -> None:
    metadata, weights = tiny_llama_metadata(), tiny_llama(vocab_size=49152)
    assert load_gguf(write_gguf(tmp_path / "plain.gguf", metadata, weights)).config.num_layers == 1
    factors = {"rope_freqs.weight": np.ones(2, dtype=np.float32)}  # head_dim / 2, as llama.cpp writes it
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        load_gguf(write_gguf(tmp_path / "llama31.gguf", metadata, {**weights, **factors}))


def hf_tokenizer_dir(directory: Path, edit) -> Path:
    """The bundled tokenizer as Hugging Face files, ``edit`` applied to its ``tokenizer.json`` spec."""
    directory.mkdir()
    load_tokenizer().save_hf_files(directory)
    spec = json.loads((directory / "tokenizer.json").read_text())
    edit(spec)
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return directory


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda spec: spec.update(normalizer={"type": "NFC"}), "normalizer"),
        (lambda spec: spec["model"].update(ignore_merges=True), "ignore_merges"),
        (lambda spec: spec["model"].update(byte_fallback=True), "byte_fallback"),
    ],
)
def test_a_tokenizer_json_with_a_normalizer_or_bpe_option_we_do_not_implement_is_refused(
    tmp_path: Path, edit, named: str
) -> None:
    assert ChatTokenizer.from_hf_dir(hf_tokenizer_dir(tmp_path / "plain", lambda spec: None))
    with pytest.raises(ValueError, match=named):
        ChatTokenizer.from_hf_dir(hf_tokenizer_dir(tmp_path / "edited", edit))


def test_rope_scaling_in_config_json_is_refused(tmp_path: Path) -> None:
    llama31 = {"type": "llama3", "factor": 8.0, "original_max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_scaling": llama31}))
    with pytest.raises(ValueError, match="RoPE scaling"):
        read_hf_config(tmp_path)


def ports() -> list[str]:
    return ["--port", str(free_port()), "--metrics-port", str(free_port())]


def refusal(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S
    )


def test_the_engine_refuses_to_start_on_a_model_it_would_compute_wrongly(tmp_path: Path) -> None:
    factors = {"rope_freqs.weight": np.ones(2, dtype=np.float32)}
    path = write_gguf(tmp_path / "llama31.gguf", tiny_llama_metadata(), {**tiny_llama(49152), **factors})
    ended = refusal(["-m", "engine", "--backend", "cpu", "--model", str(path), *ports()])
    assert ended.returncode == 2, ended.stderr
    assert "rope_freqs.weight" in ended.stderr and "Traceback" not in ended.stderr


def test_the_orchestrator_refuses_to_start_on_a_tokenizer_it_would_split_wrongly(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama3.gguf", bundled_metadata({"tokenizer.ggml.pre": "llama-bpe"}))
    argv = ["-m", "orchestrator", "--model-file", str(path), *ports(), *session_keys().service_flags()]
    ended = refusal(argv)
    assert ended.returncode == 2, ended.stderr
    assert "llama-bpe" in ended.stderr and "Traceback" not in ended.stderr
