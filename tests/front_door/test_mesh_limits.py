"""The limits an operator sets are the orchestrator's flags, and only those: raised there, the edge and
the store follow (Envoy -> edge -> orchestrator -> router -> null engines, Cassandra storing)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh
from tests.front_door.helpers import answer, assert_json_error, send

OLD_MESSAGE_BYTES = 32 * 1024


@pytest.fixture(scope="module")
def raised_door(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, mesh: Mesh
) -> Iterator[FrontDoor]:
    with (
        mesh.replica(max_message_bytes=2 * OLD_MESSAGE_BYTES, max_model_chars=256) as orchestrator,
        Launcher(tmp_path_factory.mktemp("raised-limits"), echo=lambda line: None) as launcher,
    ):
        yield start_front_door(
            launcher, dev_jwt_keys, [orchestrator.port], edge_flags=("--max-body-bytes", str(128 * 1024))
        )


def test_a_message_over_the_old_32_kib_goes_through_the_edge_and_is_stored(raised_door: FrontDoor):
    # 40 KiB of a word that is one token each, so the prompt fits the model's context window.
    content = " information" * ((OLD_MESSAGE_BYTES + 8 * 1024) // len(" information"))
    with raised_door.client(f"limits-{uuid.uuid4().hex[:8]}") as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        events = send(client, chat_id, content, options={"max_tokens": 4})
        assert events[-1].event == "done", events[-1]
        stored = client.get(f"/v1/chats/{chat_id}/messages").json()["messages"]
        assert [m["content"] for m in stored if m["role"] == "user"] == [content]
        # Over the raised limit, the orchestrator refuses it, and the edge says so with the new limit.
        with answer(client, chat_id, "x" * (2 * OLD_MESSAGE_BYTES + 1)) as reply:
            reply.read()
            assert str(2 * OLD_MESSAGE_BYTES) in assert_json_error(reply, 413)["message"]


def test_a_model_name_over_the_old_128_characters_passes_the_limits(raised_door: FrontDoor):
    with raised_door.client(f"limits-{uuid.uuid4().hex[:8]}") as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        with answer(client, chat_id, "hi", options={"model": "m" * 200}) as reply:
            reply.read()
            # Past the edge's and the orchestrator's limits: no model of that name is served.
            assert "not found; served models:" in assert_json_error(reply, 404)["message"]
