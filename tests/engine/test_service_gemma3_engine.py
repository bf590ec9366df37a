"""A real ``python -m engine --backend cpu --model <Gemma 3 GGUF>`` process over real gRPC: the engine serves
the second model family with its own tokenizer (262,144 SentencePiece tokens, BOS-led prompts)."""

from __future__ import annotations

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.model_files import gemma3_model_path
from chatmesh.tokenizer import ChatTokenizer, load_tokenizer
from tests.engine.core_helpers import released_pieces
from tests.engine.service_client import TIMEOUT_S, Stream, engine_stub, start_frame


@pytest.fixture(scope="module")
def gemma_tokenizer() -> ChatTokenizer:
    return load_tokenizer(str(gemma3_model_path()))


@pytest.fixture(scope="module")
def gemma_engine(start_engines):
    [engine] = start_engines(1, "cpu", model=gemma3_model_path())
    return engine


@pytest.fixture
async def stub(gemma_engine):
    async with engine_stub(gemma_engine.address) as stub:
        yield stub


async def test_the_engine_advertises_gemmas_model_and_tokenizer(stub, gemma_tokenizer) -> None:
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    assert info.model == gemma_tokenizer.model_name
    assert info.tokenizer_fingerprint == gemma_tokenizer.fingerprint
    assert info.vocab_size == 262_144
    assert 0 < info.context_length <= 32_768  # the file's, or what the KV pool holds


async def test_asked_for_the_capital_of_france_it_answers_paris(stub, gemma_tokenizer) -> None:
    prompt = gemma_tokenizer.encode_prompt("Q: What is the capital of France?\nA:")
    outcome = await Stream.start(stub, start_frame("paris", prompt, max_tokens=8)).rest()
    assert "Paris" in outcome.text
    assert outcome.text == gemma_tokenizer.decode(outcome.token_ids)
    assert outcome.pieces == released_pieces(gemma_tokenizer, outcome.token_ids)
    assert outcome.finished.usage.prompt_tokens == len(prompt)
