"""The orchestrator's served models (orchestrator/prompting/models.py) over the real model files: names,
kinds, licences, the default, refusals, and the prompt caches each tokenizer keeps apart."""

from __future__ import annotations

import grpc
import pytest

from chatmesh.errors import ServiceError
from chatmesh.model_files import bundled_model_path, gemma3_model_path
from orchestrator.config import PromptConfig
from orchestrator.prompting.models import ModelFile, Models, ModelSpec, default_model


@pytest.fixture(scope="module")
def specs() -> list[ModelSpec]:
    smollm2 = bundled_model_path()
    files = [ModelFile.parse(str(gemma3_model_path())), ModelFile.parse(str(smollm2))]
    files.append(ModelFile.parse(f"twin={smollm2}"))
    return [ModelSpec.load(file) for file in files]


@pytest.fixture(scope="module")
def models(specs: list[ModelSpec]) -> Models:
    return Models.over(None, specs, PromptConfig(context_window=8192))  # type: ignore[arg-type]


def test_each_file_serves_a_model_of_its_kind_licence_and_window(models: Models) -> None:
    gemma, smollm2, twin = (
        models.get(name) for name in ("gemma-3-270m-q4_k_m", "SmolLM2-135M-Instruct", "twin")
    )
    assert (gemma.kind, gemma.licence, gemma.context_window) == ("completion", "Gemma Terms of Use", 8192)
    assert (smollm2.kind, smollm2.licence, smollm2.context_window) == ("chat", "Apache-2.0", 8192)
    assert twin.tokenizer is smollm2.tokenizer  # one tokenizer per fingerprint in the process
    # The default is the first chat model, though Gemma's file came first.
    assert models.default == "SmolLM2-135M-Instruct" and models.get("") is smollm2


def test_encoded_texts_are_shared_within_a_tokenizer_and_never_across_two(models: Models) -> None:
    gemma, smollm2, twin = (
        models.get(name).prompter for name in ("gemma-3-270m-q4_k_m", "SmolLM2-135M-Instruct", "twin")
    )
    assert smollm2.recent is twin.recent and smollm2.recent is not None
    assert gemma.recent is not smollm2.recent and gemma.recent is not None


def test_unknown_models_and_chats_on_a_completion_model_are_refused_naming_the_field(models: Models) -> None:
    with pytest.raises(ServiceError) as unknown:
        models.get("no-such-model")
    assert (unknown.value.code, unknown.value.field) == (grpc.StatusCode.NOT_FOUND, "options.model")
    assert "SmolLM2-135M-Instruct" in unknown.value.message
    with pytest.raises(ServiceError) as chat:
        models.for_chat("gemma-3-270m-q4_k_m", field="model")
    assert (chat.value.code, chat.value.field) == (grpc.StatusCode.INVALID_ARGUMENT, "model")
    assert "completion model" in chat.value.message and "/v1/completions" in chat.value.message
    assert models.for_chat("twin").name == "twin"


def test_a_default_not_served_or_two_files_under_one_name_are_refused(specs: list[ModelSpec]) -> None:
    with pytest.raises(ValueError, match="none of the served models"):
        default_model(specs, "no-such-model")
    with pytest.raises(ValueError, match="is a completion model"):
        default_model(specs, "gemma-3-270m-q4_k_m")
    with pytest.raises(ValueError, match="same model name"):
        default_model([*specs, specs[1]], "")
    assert default_model(specs[:1], "") == "gemma-3-270m-q4_k_m"  # no chat model: the first one
