"""The context window a model declares, as the orchestrator reads it from the file or directory the chart
mounts: a GGUF's header, or a Hugging Face directory's config.json."""

from __future__ import annotations

import json

import pytest

from chatmesh.model_files import bundled_model_path, model_context_length


def test_a_gguf_declares_its_context_length_in_its_header():
    assert model_context_length(bundled_model_path()) == 8192  # SmolLM2-135M-Instruct


def test_a_hugging_face_directory_declares_it_in_config_json_or_its_text_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "max_position_embeddings": 131072})
    )
    assert model_context_length(tmp_path) == 131072
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 32768}}))
    assert model_context_length(tmp_path) == 32768


def test_a_directory_without_one_is_refused_naming_the_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model_context_length(tmp_path)
