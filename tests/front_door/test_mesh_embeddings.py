"""Embeddings through the whole mesh: Envoy → edge (``POST /v1/embeddings``) → orchestrator (budget) →
router (the embedding pool) → a real all-MiniLM-L6-v2 engine, beside a generation engine the same router
places chat answers on; driven with the unmodified ``openai`` SDK and plain HTTP."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pytest

from chatmesh.model_files import bundled_model_path, minilm_model_path
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.cassandra import CassandraTestNode
from tests.fixtures.engines import EngineFactory
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh
from tests.fixtures.router import router_spec, wait_for_engines

MODEL = "all-MiniLM-L6-v2"
CASES = json.loads((Path(__file__).parent.parent / "data" / "minilm_llamacpp.json").read_text())["cases"]
# The free tier's budget here: a few small calls, then 429.
FREE_BUDGET_TOKENS = 60


@dataclass(frozen=True)
class EmbeddingMesh:
    door: FrontDoor
    mesh: Mesh


@pytest.fixture(scope="module")
def embedding_mesh(
    tmp_path_factory: pytest.TempPathFactory,
    dev_jwt_keys: DevKeys,
    mesh_launcher: Launcher,
    cassandra_node: CassandraTestNode,
    start_engines: EngineFactory,
) -> Iterator[EmbeddingMesh]:
    engines = [
        *start_engines(1, "null", null_tokens_per_s=0),
        *start_engines(1, "cpu", model=minilm_model_path(), threads=1),
    ]
    port = free_port()
    mesh_launcher.start(router_spec("router-embeddings", port, engines))
    wait_for_engines(f"127.0.0.1:{port}", len(engines))
    mesh = Mesh(mesh_launcher, cassandra_node, engines, f"127.0.0.1:{port}", "router-embeddings")
    orchestrator = mesh.start_orchestrator(
        model_file=[str(bundled_model_path())], budget_free_tokens=FREE_BUDGET_TOKENS
    )
    with Launcher(tmp_path_factory.mktemp("embeddings-door"), echo=lambda line: None) as launcher:
        yield EmbeddingMesh(start_front_door(launcher, dev_jwt_keys, [orchestrator.port]), mesh)


def _reference(case: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(case["embedding_f32_b64"]), dtype="<f4")


def test_the_sdk_gets_the_reference_vectors_and_the_tokens_it_was_charged(
    embedding_mesh: EmbeddingMesh, user: str
) -> None:
    sdk = embedding_mesh.door.sdk(user)  # the SDK asks for base64 and decodes it
    cases = CASES[:5]
    reply = sdk.embeddings.create(model=MODEL, input=[c["text"] for c in cases])
    assert reply.model == MODEL and [d.index for d in reply.data] == list(range(len(cases)))
    for data, case in zip(reply.data, cases, strict=True):
        assert float(np.asarray(data.embedding, dtype=np.float32) @ _reference(case)) >= 0.999
    tokens = sum(len(c["token_ids"]) for c in cases)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == tokens
    with embedding_mesh.door.client(user) as http:
        assert http.get("/v1/usage").json()["used_tokens"] == tokens


def test_float_token_arrays_and_the_models_own_dimensions(embedding_mesh: EmbeddingMesh, user: str) -> None:
    text = CASES[1]
    ids = text["token_ids"][1:-1]
    with embedding_mesh.door.client(user) as http:
        as_text = http.post(
            "/v1/embeddings",
            json={"model": MODEL, "input": text["text"], "encoding_format": "float", "user": "x"},
        )
        as_ids = http.post("/v1/embeddings", json={"model": MODEL, "input": ids, "dimensions": 384})
        both = http.post("/v1/embeddings", json={"model": MODEL, "input": [ids, ids[:3]]})
    assert as_text.status_code == as_ids.status_code == both.status_code == 200, as_text.text
    body = as_text.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    vector = np.asarray(body["data"][0]["embedding"], dtype=np.float32)
    assert vector.shape == (384,) and float(vector @ _reference(text)) >= 0.999
    assert as_ids.json()["data"][0]["embedding"] == body["data"][0]["embedding"]
    assert len(both.json()["data"]) == 2 and both.json()["usage"]["prompt_tokens"] == len(ids) + 2 + 3 + 2


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"model": MODEL, "input": "word " * 300}, 400, "input[0]", "at most 256"),
        ({"model": MODEL, "input": ["fine", ""]}, 400, "input[1]", "input 1 is empty"),
        ({"model": MODEL, "input": []}, 400, "input", "1 to 2048"),
        ({"model": MODEL, "input": "a", "dimensions": 128}, 400, "dimensions", "not trained"),
        ({"model": MODEL, "input": "a", "encoding_format": "int8"}, 400, "encoding_format", ""),
        ({"model": MODEL, "input": "a", "extra": 1}, 400, "extra", ""),
        ({"model": "no-such-model", "input": "a"}, 404, None, "no embedding engine serves"),
    ],
)
def test_refusals_in_openai_shape(
    embedding_mesh: EmbeddingMesh, user: str, body, status, param, words
) -> None:
    with embedding_mesh.door.client(user) as http:
        reply = http.post("/v1/embeddings", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "Traceback" not in reply.text


def test_a_spent_budget_refuses_embeddings_and_a_refused_call_costs_nothing(
    embedding_mesh: EmbeddingMesh, user: str
) -> None:
    with embedding_mesh.door.client(user, tier="free") as http:
        refused = http.post("/v1/embeddings", json={"model": MODEL, "input": "word " * 300})
        assert refused.status_code == 400 and http.get("/v1/usage").json()["used_tokens"] == 0
        spent = 0
        while True:
            reply = http.post("/v1/embeddings", json={"model": MODEL, "input": "a short sentence to embed"})
            if reply.status_code != 200:
                break
            spent += reply.json()["usage"]["prompt_tokens"]
    assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
    assert 0 < spent <= FREE_BUDGET_TOKENS


def test_chat_still_goes_to_the_generation_engine(embedding_mesh: EmbeddingMesh, user: str) -> None:
    sdk = embedding_mesh.door.sdk(user)
    answer = sdk.chat.completions.create(
        model="", messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 4
    with pytest.raises(openai.APIStatusError) as refused:
        sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4
        )
    assert refused.value.status_code in (400, 404)
