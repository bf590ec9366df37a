"""The examples/ scripts run as a user would run them against `make run`'s door: through the real Envoy
and edge over the shared test mesh (null engines at 200 tokens/s, Cassandra). The OpenAI chat example
streams an answer; the Responses example drops its stream part way and resumes it with nothing lost;
the gRPC example resumes its answer after the replica streaming it drains (SIGTERM, as in every rolling
deploy), and prints exactly the answer that was stored."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import grpc
import httpx
import openai

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.front_door import MeshFrontDoor, start_front_door
from tests.fixtures.orchestrator import Mesh, orchestrator_spec
from tests.front_door.helpers import wait_for

ROOT = Path(__file__).resolve().parents[2]
# A drained replica hands its runs over at once, and the other adopts them within a second.
HAND_OVER_FAST = {
    "drain_grace_s": 0.2,
    "heartbeat_interval_s": 0.5,
    "orphan_after_s": 2.0,
    "reap_interval_s": 0.5,
}


def run_example(script: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_openai_chat_example_streams_an_answer(mesh_front_door: MeshFrontDoor, user: str):
    token = mesh_front_door.envoy.token(user, "enterprise")
    done = run_example(
        "openai_chat.py",
        "--base-url",
        f"{mesh_front_door.url}/v1",
        "--token",
        token,
        "--max-tokens",
        "8",
        "Hi",
    )
    assert done.returncode == 0, done.stderr
    assert "[finish_reason: length]" in done.stdout
    assert "completion tokens]" in done.stdout and " 8 completion tokens" in done.stdout


def test_openai_responses_example_resumes_a_dropped_stream_with_nothing_lost(
    mesh_front_door: MeshFrontDoor, user: str
):
    token = mesh_front_door.envoy.token(user, "enterprise")
    done = run_example(
        "openai_responses.py",
        "--base-url",
        f"{mesh_front_door.url}/v1",
        "--token",
        token,
        "--max-output-tokens",
        "40",
        "Hi",
    )
    assert done.returncode == 0, done.stderr
    before, _, after = done.stdout.partition("\n[stream dropped after event ")
    resumed = re.match(
        r"\d+; resuming (\S+)\]\n(.*)\n\[incomplete; 40 output tokens\]\nfollow-up: ", after, re.S
    )
    assert resumed, done.stdout
    response_id, rest = resumed.groups()
    sdk = openai.OpenAI(base_url=f"{mesh_front_door.url}/v1", api_key=token, max_retries=0)
    assert before + rest == sdk.responses.retrieve(response_id).output_text


def active_runs(metrics_url: str) -> float:
    found = re.search(r"^chatmesh_orchestrator_active_runs (\S+)$", httpx.get(metrics_url).text, re.M)
    return float(found.group(1)) if found else 0.0


def test_grpc_example_resumes_its_answer_after_the_replica_streaming_it_drains(
    tmp_path: Path, dev_jwt_keys: DevKeys, mesh: Mesh
):
    with Launcher(tmp_path, echo=lambda line: None) as launcher:
        replicas = []
        for _ in range(2):
            name, port, metrics_port = f"orchestrator-{uuid.uuid4().hex[:6]}", free_port(), free_port()
            cql_port = mesh.cassandra.node.config.cql_port
            spec = orchestrator_spec(
                name, port, metrics_port, mesh.router_address, cql_port, replica_id=name, **HAND_OVER_FAST
            )
            launcher.start(spec)
            replicas.append((name, port, f"http://127.0.0.1:{metrics_port}/metrics"))
        door = start_front_door(launcher, dev_jwt_keys, [port for _, port, _ in replicas])
        token = door.envoy.token(f"u-{uuid.uuid4().hex[:8]}", "enterprise")
        # 600 tokens: three seconds at the engines' pace, long enough to drain its replica under it.
        example = subprocess.Popen(
            [
                sys.executable,
                "examples/grpc_client.py",
                "--target",
                door.envoy.grpc_target,
                "--token",
                token,
                "--max-tokens",
                "600",
                "Tell me a long story.",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            streaming = wait_for(
                lambda: next((r for r in replicas if active_runs(r[2]) >= 1), None),
                what="the answer generating",
            )
            time.sleep(0.5)  # some of it streamed
            launcher.stop(streaming[0])  # SIGTERM: it drains and hands the run over
            stdout, stderr = example.communicate(timeout=60)
        finally:
            example.kill()
        assert example.returncode == 0, stderr
        assert re.search(r"\[stream broke \(.*\); resuming run \S+ after event \d+\]", stderr), stderr
        ended = re.search(r"\n\[FINISH_REASON_LENGTH; chat (\S+), message (\S+)\]\n$", stdout)
        assert ended, stdout
        chat_id, message_id = ended.groups()
        printed = stdout.split("\n[", 1)[0]
        with grpc.insecure_channel(door.envoy.grpc_target) as channel:
            messages = (
                chat_pb2_grpc.ChatServiceStub(channel)
                .ListMessages(
                    chat_pb2.ListMessagesRequest(chat_id=chat_id),
                    metadata=(("authorization", f"Bearer {token}"),),
                    timeout=10,
                )
                .messages
            )
        [stored] = [m for m in messages if m.message_id == message_id]
        assert stored.content == printed  # no gap, no repeat across the drain
        assert stored.token_count == 600
