"""Models whose tokenizer, positions, architecture or tensors chatmesh does not implement are refused at
start, naming what is unsupported, rather than loaded to split text into wrong ids or compute wrong
logits without an error (issue 54 item 0, issue 57 item 3): a GGUF with another pre-tokenizer than
SmolLM's or another tokenizer model (Llama 3's, Qwen's, Mistral Nemo's among them), RoPE scaling other
than Llama 3's frequency factors, an architecture, tensor type or per-architecture detail the engine does
not compute, and the same in a Hugging Face directory (a ``tokenizer.json`` normalizer or BPE option,
``rope_scaling`` in ``config.json``). The engine and the orchestrator each exit with the message,
without a traceback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
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
        ({"tokenizer.ggml.pre": "llama-bpe"}, "tokenizer.ggml.pre is 'llama-bpe'"),  # Llama 3
        ({"tokenizer.ggml.pre": "qwen2"}, "tokenizer.ggml.pre is 'qwen2'"),  # Qwen2, Qwen2.5, Qwen3
        ({"tokenizer.ggml.pre": "tekken"}, "tokenizer.ggml.pre is 'tekken'"),  # Mistral Nemo, Small 3
        ({"tokenizer.ggml.pre": REMOVED}, "tokenizer.ggml.pre is not set"),
        (
            {"tokenizer.ggml.model": "llama"},
            "tokenizer.ggml.model is 'llama', tokenizer.ggml.pre is 'smollm'",
        ),
        ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model is 'bert'"),
        # SentencePiece without its scores
        ({"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default"}, "needs tokenizer.ggml.scores"),
    ],
)
def test_a_gguf_tokenizer_other_than_the_two_we_implement_is_refused_naming_it(
    tmp_path: Path, change, named
) -> None:
    path = write_gguf(tmp_path / "model.gguf", bundled_metadata(change))
    with pytest.raises(ValueError) as refused:
        ChatTokenizer.from_gguf(path)
    assert named in str(refused.value)


def test_a_gguf_with_smollms_tokenizer_loads(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "model.gguf", bundled_metadata())
    assert ChatTokenizer.from_gguf(path).fingerprint == load_tokenizer().fingerprint


def test_a_gguf_with_rope_frequency_factors_loads_them(tmp_path: Path) -> None:
    metadata, weights = tiny_llama_metadata(), tiny_llama(vocab_size=49152)
    assert load_gguf(write_gguf(tmp_path / "plain.gguf", metadata, weights)).config.rope_freq_factors == ()
    factors = {
        "rope_freqs.weight": np.array([1.0, 8.0], dtype=np.float32)
    }  # head_dim / 2, as llama.cpp has it
    loaded = load_gguf(write_gguf(tmp_path / "llama31.gguf", metadata, {**weights, **factors}))
    assert loaded.config.rope_freq_factors == (1.0, 8.0)


@pytest.mark.parametrize("scaling", ["yarn", "linear", "longrope"])
def test_rope_scaling_other_than_frequency_factors_is_refused_naming_it(tmp_path: Path, scaling: str) -> None:
    metadata = {**tiny_llama_metadata(), "llama.rope.scaling.type": scaling, "llama.rope.scaling.factor": 4.0}
    with pytest.raises(ValueError, match=f"RoPE scaling '{scaling}' is not supported"):
        load_gguf(write_gguf(tmp_path / "scaled.gguf", metadata, tiny_llama(vocab_size=49152)))


def qwen2(hidden: int = 8) -> tuple[dict[str, object], dict[str, np.ndarray]]:
    """``tiny_llama`` as a qwen2 file (biases on q, k and v)."""
    metadata = {
        ("qwen2" + key[len("llama") :] if key.startswith("llama.") else key): value
        for key, value in tiny_llama_metadata(hidden).items()
    }
    metadata["general.architecture"] = "qwen2"
    weights = tiny_llama(vocab_size=49152, hidden=hidden)
    biases = {f"blk.0.attn_{t}.bias": np.zeros(hidden, dtype=np.float32) for t in "qkv"}
    return metadata, {**weights, **biases}


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # llama.cpp reads Llama 3's factors on llama only
        (lambda m, w: w.update({"rope_freqs.weight": np.ones(2, dtype=np.float32)}), "rope_freqs.weight"),
        # llama.cpp's qwen2 graph ignores the window: a file that means it would be computed wrongly
        (lambda m, w: m.update({"qwen2.attention.sliding_window": 16}), "qwen2.attention.sliding_window"),
        (lambda m, w: w.pop("blk.0.attn_v.bias"), "biases on only some of attn_q, attn_k, attn_v"),
        (lambda m, w: m.update({"qwen2.rope.dimension_count": 2}), "rope.dimension_count"),
    ],
)
def test_a_detail_the_engine_does_not_compute_is_refused_naming_it(
    tmp_path: Path, change, named: str
) -> None:
    metadata, weights = qwen2()
    assert load_gguf(write_gguf(tmp_path / "qwen2.gguf", metadata, weights)).config.architecture == "qwen2"
    change(metadata, weights)
    with pytest.raises(ValueError, match=re.escape(named)):
        load_gguf(write_gguf(tmp_path / "changed.gguf", metadata, weights))


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "BF16"])
def test_a_tensor_type_the_engine_does_not_run_is_refused_naming_it(tmp_path: Path, qtype: str) -> None:
    metadata, weights = tiny_llama_metadata(hidden=32, heads=2), tiny_llama(vocab_size=49152, hidden=32)
    quantized = (weights["blk.0.attn_q.weight"], gguf.GGMLQuantizationType[qtype])
    with pytest.raises(ValueError, match=f"tensor blk.0.attn_q.weight is of type {qtype}"):
        load_gguf(write_gguf(tmp_path / "q.gguf", metadata, {**weights, "blk.0.attn_q.weight": quantized}))


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
    metadata = {**tiny_llama_metadata(), "llama.rope.scaling.type": "yarn"}
    path = write_gguf(tmp_path / "yarn.gguf", metadata, tiny_llama(49152))
    ended = refusal(["-m", "engine", "--backend", "cpu", "--model", str(path), *ports()])
    assert ended.returncode == 2, ended.stderr
    assert "RoPE scaling 'yarn'" in ended.stderr and "Traceback" not in ended.stderr


def test_the_orchestrator_refuses_to_start_on_a_tokenizer_it_would_split_wrongly(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "llama3.gguf", bundled_metadata({"tokenizer.ggml.pre": "llama-bpe"}))
    argv = ["-m", "orchestrator", "--model-file", str(path), *ports(), *session_keys().service_flags()]
    ended = refusal(argv)
    assert ended.returncode == 2, ended.stderr
    assert "llama-bpe" in ended.stderr and "Traceback" not in ended.stderr


def test_the_orchestrator_refuses_to_start_on_a_model_without_a_chat_template(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "base.gguf", bundled_metadata({"tokenizer.chat_template": REMOVED}))
    argv = ["-m", "orchestrator", "--model-file", str(path), *ports(), *session_keys().service_flags()]
    ended = refusal(argv)
    assert ended.returncode == 2, ended.stderr
    assert "has no chat template" in ended.stderr and "Traceback" not in ended.stderr


def test_a_gguf_of_an_architecture_the_engine_does_not_run_is_refused_naming_it(tmp_path: Path) -> None:
    metadata = {**tiny_llama_metadata(), "general.architecture": "phi3"}
    only = r"\(only llama, qwen2, qwen3, gemma3\)"
    with pytest.raises(ValueError, match=rf"architecture 'phi3' is not supported {only}"):
        load_gguf(write_gguf(tmp_path / "phi3.gguf", metadata, tiny_llama(vocab_size=49152)))
