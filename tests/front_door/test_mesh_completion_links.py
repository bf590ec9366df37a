"""The edge's completion links under a crash: the OpenAI route's answers travel many to a CompleteMany
stream, each stream to an orchestrator replica. Through the real Envoy and edge to two real replicas
over the shared mesh; one is killed (SIGKILL), or drains, while eight answers stream. The edge reaches
each replica itself (``make run``'s way and the Helm chart's)."""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import uuid
from pathlib import Path

import grpc
import httpx
import pytest

from chatmesh.chat.v1 import completion_link_pb2, completion_link_pb2_grpc
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh, orchestrator_spec
from tests.front_door.fuzzing import leaks
from tests.front_door.helpers import kill_under_answers

PROMPT = [{"role": "user", "content": "a long answer, please"}]
# 10 s at the mesh engines' 200 tokens a second: still streaming when the replica dies.
LONG = {"model": "", "messages": PROMPT, "max_tokens": 2000, "stream": True}
STREAMS = 8


def start_replicas(launcher: Launcher, mesh: Mesh) -> tuple[list[str], list[int]]:
    """Two orchestrator replicas over the mesh's router and Cassandra: their names and ports."""
    names, ports = [], []
    for _ in range(2):
        name, port = f"orchestrator-{uuid.uuid4().hex[:6]}", free_port()
        cql_port = mesh.cassandra.node.config.cql_port
        launcher.start(
            orchestrator_spec(name, port, free_port(), mesh.router_address, cql_port, replica_id=name)
        )
        names.append(name)
        ports.append(port)
    return names, ports


def stream_answer(door: FrontDoor, started: threading.Event, lines: list[str], body: dict = LONG) -> None:
    with (
        door.client(f"u-{uuid.uuid4().hex[:8]}") as client,
        client.stream("POST", "/v1/chat/completions", json=body, timeout=60) as reply,
    ):
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
            if '"content"' in line:
                started.set()


def test_a_replica_killed_under_completions_fails_only_its_own_answers_and_the_next_are_answered(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        names, ports = start_replicas(launcher, mesh)
        door = start_front_door(launcher, dev_jwt_keys, ports)
        started = [threading.Event() for _ in range(STREAMS)]
        streamed: list[list[str]] = [[] for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream_answer, args=(door, started[n], streamed[n]), daemon=True)
            for n in range(STREAMS)
        ]
        kill_under_answers(launcher, names[0], threads, started, join_s=60)

        finished = [lines for lines in streamed if lines[-1] == "data: [DONE]"]
        failed = [lines for lines in streamed if lines[-1] != "data: [DONE]"]
        # The answers went on links to both replicas (the edge's own choice): both kinds are here.
        assert finished and failed, [lines[-1] for lines in streamed]
        for lines in failed:
            error = json.loads(lines[-1].removeprefix("data: "))["error"]
            # A plain 503-kind error to retry, without the transport's text or our addresses.
            assert error["code"] == "unavailable" and "retry" in error["message"], error
            assert not leaks(lines[-1], "") and "127.0.0.1" not in lines[-1], lines[-1]

        # The next answers go on links to the replica that lives (the broken ones open again there).
        with door.client(f"u-{uuid.uuid4().hex[:8]}") as client:
            short = {"model": "", "messages": PROMPT, "max_tokens": 4}
            for _ in range(STREAMS):
                reply = client.post("/v1/chat/completions", json=short)
                assert reply.status_code == 200, reply.text
        # The dead replica's answers free their engine work (its router stream broke with it).
        deadline = time.monotonic() + 15
        while mesh.engine_requests():
            assert time.monotonic() < deadline, "the dead replica's answers still hold engine work"
            time.sleep(0.2)
        launcher.forget(names[0])


def test_a_replica_that_drains_finishes_the_answers_on_its_links_and_new_ones_go_elsewhere(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        names, ports = start_replicas(launcher, mesh)
        door = start_front_door(launcher, dev_jwt_keys, ports)
        # 3 s answers: they end well inside the drain's grace.
        body = {**LONG, "max_tokens": 600}
        started = [threading.Event() for _ in range(STREAMS)]
        streamed: list[list[str]] = [[] for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=stream_answer, args=(door, started[n], streamed[n], body), daemon=True)
            for n in range(STREAMS)
        ]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30), "an answer did not start"
        stopping = threading.Thread(target=launcher.stop, args=(names[0],), daemon=True)
        stopping.start()  # SIGTERM: it refuses new answers while its links carry the running ones
        # Answers asked meanwhile are answered: one its replica refused goes again on a new link.
        short = {"model": "", "messages": PROMPT, "max_tokens": 4}
        asked = 0
        while stopping.is_alive():
            with door.client(f"u-{uuid.uuid4().hex[:8]}") as client:  # a user each: no rate limit
                reply = client.post("/v1/chat/completions", json=short)
            assert reply.status_code == 200, reply.text
            asked += 1
        assert asked >= 10
        for thread in threads:
            thread.join(60)
        assert [lines[-1] for lines in streamed] == ["data: [DONE]"] * STREAMS


def test_the_edge_killed_under_completions_frees_their_engine_work_and_the_public_door_has_no_link(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        _, ports = start_replicas(launcher, mesh)
        door = start_front_door(launcher, dev_jwt_keys, ports)
        # The link is internal: the public listener does not route it, whatever the caller's token.
        with grpc.insecure_channel(door.envoy.grpc_target) as channel:
            link = completion_link_pb2_grpc.CompletionLinkServiceStub(channel).CompleteMany(
                iter([completion_link_pb2.CompleteManyRequest()]), metadata=door.grpc_auth("u"), timeout=10
            )
            with pytest.raises(grpc.RpcError) as refused:
                list(link)
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED

        def answer_cut_short(started: threading.Event) -> None:
            with contextlib.suppress(httpx.HTTPError):  # its stream breaks with the edge
                stream_answer(door, started, [])

        started = [threading.Event() for _ in range(4)]
        threads = [threading.Thread(target=answer_cut_short, args=(event,), daemon=True) for event in started]
        for thread in threads:
            thread.start()
        for event in started:
            assert event.wait(30), "an answer did not start"
        assert mesh.engine_requests() >= 4
        # The edge dies with its links: Envoy resets their streams, and the orchestrators cancel the
        # answers on them (a Complete nobody can resume).
        launcher.signal("edge", signal.SIGKILL)
        deadline = time.monotonic() + 5  # left alone, the answers would run ~9 s more
        while mesh.engine_requests():
            assert time.monotonic() < deadline, "answers went on after the edge carrying them died"
            time.sleep(0.2)
        launcher.forget("edge")
        for thread in threads:
            thread.join(10)
