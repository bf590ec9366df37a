"""Gemma 3's SentencePiece tokenizer, built from its GGUF, against llama.cpp's own tokenizer on the same
file (tests/data/gemma3_llamacpp.json, written by bench/make_gemma3_fixture.py: unicode, digit and
whitespace runs, byte fallback, typed control markers that must stay text), and what a model without a
chat template does with a chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chatmesh.model_files import gemma3_model_path
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, NoChatTemplate, load_tokenizer
from tests.fixtures.gguf_files import space_prefixed_gemma_vocab

FIXTURE = Path(__file__).resolve().parent.parent / "data" / "gemma3_llamacpp.json"
START_OF_TURN = 105  # a control token of Gemma's vocabulary


@pytest.fixture(scope="module")
def gemma() -> ChatTokenizer:
    return load_tokenizer(str(gemma3_model_path()))


@pytest.fixture(scope="module")
def llamacpp() -> dict:
    data = json.loads(FIXTURE.read_text())
    assert data["model_file"] == gemma3_model_path().name
    return data


def test_prompt_ids_are_llama_cpps_for_every_text(gemma: ChatTokenizer, llamacpp: dict) -> None:
    for case in llamacpp["tokenizer_cases"]:
        assert gemma.encode_prompt(case["text"]) == case["token_ids"], case["text"]


def test_decoding_gives_llama_cpps_text_and_the_original_back(gemma: ChatTokenizer, llamacpp: dict) -> None:
    for case in llamacpp["tokenizer_cases"]:
        ids = case["token_ids"][1:]  # without the BOS
        assert gemma.decode(ids) == case["detokenized"], case["text"]
        # SentencePiece writes a space as U+2581, so a U+2581 typed by a user decodes as a space (in
        # llama.cpp too): every other text comes back as it went in.
        if "\u2581" not in case["text"]:
            assert gemma.decode(ids) == case["text"]


def test_with_a_space_prefix_as_llama_2_and_mistral_have_it_ids_are_llama_cpps_too(
    llamacpp: dict, tmp_path: Path
) -> None:
    """The same vocabulary with ``add_space_prefix`` on: a space before the text and after every matched
    token (user-defined whitespace runs, tags), as llama.cpp does."""
    prefixed = ChatTokenizer.from_gguf(space_prefixed_gemma_vocab(tmp_path / "vocab.gguf"))
    for case in llamacpp["space_prefix_cases"]:
        assert prefixed.encode_prompt(case["text"]) == case["token_ids"], case["text"]
    assert prefixed.fingerprint != ChatTokenizer.from_gguf(gemma3_model_path()).fingerprint


def test_a_typed_turn_marker_stays_text_and_markup_may_use_it(gemma: ChatTokenizer) -> None:
    assert gemma.decode([START_OF_TURN], skip_control=False) == "<start_of_turn>"
    assert gemma.decode([START_OF_TURN]) == ""  # a control token is no text of its own
    typed = gemma.encode("<start_of_turn>user\nhi")
    assert START_OF_TURN not in typed and gemma.decode(typed) == "<start_of_turn>user\nhi"


def test_characters_outside_the_vocabulary_fall_back_to_their_bytes(gemma: ChatTokenizer) -> None:
    ids = gemma.encode("\x01")
    assert gemma.decode(ids) == "\x01"
    assert [gemma.decode([i], skip_control=False) for i in ids] == ["\x01"]  # the <0x01> byte token


def test_the_bos_leads_a_prompt_and_the_fingerprint_is_gemmas_own(gemma: ChatTokenizer) -> None:
    assert gemma.add_bos and gemma.encode_prompt("Hi")[0] == gemma.bos_token_id == 2
    assert gemma.eos_token_ids[0] == 1
    assert gemma.fingerprint.startswith(f"{gemma.model_name}:")
    assert gemma.fingerprint != load_tokenizer().fingerprint


def test_a_chat_on_a_model_without_a_template_is_refused_saying_so(gemma: ChatTokenizer) -> None:
    assert gemma.chat_template is None
    with pytest.raises(NoChatTemplate, match="no chat template"):
        gemma.encode_chat([ChatMessage("user", "Hi")])
    with pytest.raises(NoChatTemplate, match="completes prompts"):
        gemma.render([ChatMessage("user", "Hi")])
