"""The router's embedding pool: Embed calls placed on the engines of an embedding model (never on a
generation engine), and a kill -9 of one of them while calls go on: every call is still answered."""

from __future__ import annotations

import asyncio
import signal

import grpc
import numpy as np
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.model_files import minilm_model_path
from chatmesh.router.v1 import router_pb2, router_pb2_grpc

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def cluster(start_engines, start_router):
    embedding = start_engines(2, "cpu", model=minilm_model_path(), threads=1)
    generation = start_engines(1, "null")
    router = start_router([*embedding, *generation])
    return router, [e.name for e in embedding], generation[0].name


@pytest.fixture
async def stub(cluster):
    async with grpc.aio.insecure_channel(cluster[0].address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


def _call(text: str, model: str = "") -> router_pb2.EmbedRequest:
    return router_pb2.EmbedRequest(
        embed=engine_pb2.EmbedRequest(model=model, inputs=[engine_pb2.EmbedInput(text=text)]),
        tier=router_pb2.TIER_PRO,
    )


async def test_calls_go_to_the_embedding_pool_only(stub, cluster):
    _, embedding, generation = cluster
    answers = await asyncio.gather(*(stub.Embed(_call(f"sentence {i}"), timeout=TIMEOUT_S) for i in range(8)))
    assert {a.engine_id for a in answers} <= set(embedding) and generation not in {
        a.engine_id for a in answers
    }
    assert all(a.embed.model == "all-MiniLM-L6-v2" for a in answers)
    named = await stub.Embed(_call("sentence 0", model="all-MiniLM-L6-v2"), timeout=TIMEOUT_S)
    assert named.embed.embeddings[0].vector_f32 == answers[0].embed.embeddings[0].vector_f32
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Embed(_call("x", model="SmolLM2-135M-Instruct"), timeout=TIMEOUT_S)
    assert (
        refused.value.code() == grpc.StatusCode.NOT_FOUND
        and "no embedding engine serves" in refused.value.details()
    )


async def test_kill_9_of_an_embedding_engine_loses_no_call(stub, cluster, engine_launcher):
    _, embedding, _ = cluster
    reference = await stub.Embed(_call("the same sentence"), timeout=TIMEOUT_S)
    victim = reference.engine_id
    engine_launcher.signal(victim, signal.SIGKILL)
    engine_launcher.forget(victim)
    answers = await asyncio.gather(
        *(stub.Embed(_call("the same sentence"), timeout=TIMEOUT_S) for _ in range(6))
    )
    survivor = next(name for name in embedding if name != victim)
    assert {a.engine_id for a in answers} == {survivor}
    vector = np.frombuffer(reference.embed.embeddings[0].vector_f32, dtype="<f4")
    for answer in answers:  # the same weights and kernels: the same vector, bit for bit
        assert np.array_equal(np.frombuffer(answer.embed.embeddings[0].vector_f32, dtype="<f4"), vector)
