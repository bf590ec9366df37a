"""An embedding engine (``python -m engine --model <all-MiniLM-L6-v2 dir>``) over a real gRPC socket:
Embed answers with the reference vectors, batches concurrent callers, refuses what the model cannot
take naming the limit, and refuses generation."""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.model_files import minilm_model_path
from meshkit.launcher import free_port
from tests.engine.service_client import TIMEOUT_S, Stream, engine_stub, start_frame

CASES = json.loads((Path(__file__).parent.parent / "data" / "minilm_llamacpp.json").read_text())["cases"]


@pytest.fixture(scope="module")
def embedding_engine(start_engines):
    [engine] = start_engines(1, "cpu", model=minilm_model_path(), threads=1, metrics_port=free_port())
    return engine


@pytest.fixture
async def stub(embedding_engine):
    async with engine_stub(embedding_engine.address) as stub:
        yield stub


def _vector(embedding: engine_pb2.Embedding) -> np.ndarray:
    return np.frombuffer(embedding.vector_f32, dtype="<f4")


def _texts(*texts: str) -> engine_pb2.EmbedRequest:
    return engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(text=t) for t in texts])


async def test_model_info_says_it_embeds(stub):
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    assert info.kind == engine_pb2.MODEL_KIND_EMBEDDING
    assert (info.model, info.embedding_dimensions, info.context_length) == ("all-MiniLM-L6-v2", 384, 256)


async def test_vectors_match_the_reference_and_token_arrays_embed_as_their_text(stub):
    cases = CASES[:6]
    answer = await stub.Embed(_texts(*(c["text"] for c in cases)), timeout=TIMEOUT_S)
    assert answer.model == "all-MiniLM-L6-v2"
    for embedding, case in zip(answer.embeddings, cases, strict=True):
        reference = np.frombuffer(base64.b64decode(case["embedding_f32_b64"]), dtype="<f4")
        assert float(_vector(embedding) @ reference) >= 0.999
        assert embedding.token_count == len(case["token_ids"])
    ids = CASES[1]["token_ids"][1:-1]  # without [CLS] and [SEP]: the engine adds them
    as_ids = await stub.Embed(
        engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(token_ids=ids)]), timeout=TIMEOUT_S
    )
    assert as_ids.embeddings[0].vector_f32 == answer.embeddings[1].vector_f32


async def test_concurrent_callers_share_batches(stub, embedding_engine):
    def batches() -> float:
        url = f"http://127.0.0.1:{embedding_engine.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=TIMEOUT_S).read().decode()
        count = "chatmesh_engine_embed_batch_seconds_count"
        return float(next(line for line in text.splitlines() if line.startswith(count)).split()[1])

    before = batches()
    calls = 24
    answers = await asyncio.gather(
        *(
            stub.Embed(_texts(f"caller {i} asks about {CASES[i % len(CASES)]['text']}"), timeout=TIMEOUT_S)
            for i in range(calls)
        )
    )
    assert all(len(a.embeddings) == 1 for a in answers)
    assert batches() - before < calls  # some calls were computed together


@pytest.mark.parametrize(
    ("request_", "code", "words"),
    [
        (engine_pb2.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT, "1 to 2048 inputs"),
        (_texts("fine", ""), grpc.StatusCode.INVALID_ARGUMENT, "input 1 is empty"),
        (_texts("word " * 300), grpc.StatusCode.INVALID_ARGUMENT, "at most 256"),
        (
            engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(token_ids=[30522])]),
            grpc.StatusCode.INVALID_ARGUMENT,
            "outside the vocabulary",
        ),
        (
            engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(text="a")], dimensions=128),
            grpc.StatusCode.INVALID_ARGUMENT,
            "not trained to have them shortened",
        ),
        (
            engine_pb2.EmbedRequest(model="other", inputs=[engine_pb2.EmbedInput(text="a")]),
            grpc.StatusCode.FAILED_PRECONDITION,
            "serves 'all-MiniLM-L6-v2'",
        ),
    ],
)
async def test_refusals_name_the_problem(stub, request_, code, words):
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Embed(request_, timeout=TIMEOUT_S)
    assert refused.value.code() == code and words in refused.value.details()


async def test_the_model_at_its_dimensions_and_its_longest_input_is_taken(stub):
    longest = engine_pb2.EmbedInput(token_ids=[2088] * 254)
    answer = await stub.Embed(engine_pb2.EmbedRequest(inputs=[longest], dimensions=384), timeout=TIMEOUT_S)
    assert answer.embeddings[0].token_count == 256 and len(answer.embeddings[0].vector_f32) == 384 * 4


async def test_generation_is_refused_clearly(stub):
    stream = Stream.start(stub, start_frame("gen-1", [101, 7592, 102], max_tokens=4))
    with pytest.raises(ServiceError) as refused:
        await stream.rest()
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "does not generate" in refused.value.message


async def test_a_generation_engine_does_not_embed(null_engine):
    async with engine_stub(null_engine.address) as stub:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Embed(_texts("hello"), timeout=TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
