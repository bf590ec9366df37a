"""`make run` and the instructions it prints: the page URL, the curl SSE examples and the gRPC example
client all work as printed, first against the front door alone (localmesh.front_door in front of
ScriptedChatService), then against the whole mesh as `make run` starts it (``python -m localmesh.mesh``:
Cassandra, the real model on the cpu backend, router, orchestrator, edge, Envoy), where the printed
examples must stream the model's answer through Envoy and Ctrl-C must leave no process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from localmesh.dev_jwt import DIR_ENV, DevKeys
from localmesh.front_door import FrontDoorPorts, front_door_specs, welcome
from meshkit.launcher import Launcher, PortInUseError, free_consecutive_ports, free_port
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.helpers import wait_for

REPO_ROOT = Path(__file__).resolve().parents[2]


def fresh_ports() -> FrontDoorPorts:
    return FrontDoorPorts(envoy=free_port(), envoy_admin=free_port(), edge=free_port())


def run_printed_commands(text: str, token: str) -> subprocess.CompletedProcess:
    """Runs the example commands in the text `make run` printed (its indented lines), as printed."""
    commands = [line.strip() for line in text.splitlines() if line.startswith("    ")]
    assert len(commands) == 4  # curl completions, create chat, curl messages, gRPC client
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)],
        env={**os.environ, "TOKEN": token},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_printed_instructions_work(front_door: ScriptedFrontDoor, dev_jwt_keys: DevKeys, tmp_path):
    ports = fresh_ports()
    with Launcher(tmp_path, echo=lambda _: None) as launcher:
        for spec in front_door_specs(ports, [front_door.scripted_port], tmp_path, dev_jwt_keys):
            launcher.start(spec)
        token = dev_jwt_keys.mint("alice", "pro")
        text = welcome(ports, token, "alice", "pro")
        page_url = re.search(r"(http://\S+)/#token=(\S+)", text)
        assert page_url and page_url.group(2) == token
        # make run waited for Envoy to see healthy upstreams before printing anything.
        assert httpx.get(f"{page_url.group(1)}/healthz").status_code == 200
        assert "<title>chatmesh</title>" in httpx.get(page_url.group(1) + "/").text

        result = run_printed_commands(text, token)
    assert result.returncode == 0, result.stderr
    assert "data: [DONE]" in result.stdout  # OpenAI-compatible stream
    assert "event: done" in result.stdout  # the page's SSE stream
    assert "FINISH_REASON_STOP" in result.stdout  # the gRPC example client


def test_taken_port_is_a_clear_error(front_door: ScriptedFrontDoor, dev_jwt_keys: DevKeys, tmp_path):
    ports = fresh_ports()
    with socket.socket() as squatter, Launcher(tmp_path, echo=lambda _: None) as launcher:
        squatter.bind(("127.0.0.1", ports.envoy))
        squatter.listen()
        edge, envoy = front_door_specs(ports, [front_door.scripted_port], tmp_path, dev_jwt_keys)
        launcher.start(edge)
        with pytest.raises(PortInUseError, match=f"port {ports.envoy} needed by envoy"):
            launcher.start(envoy)


class Output:
    """The lines a process prints, read on a thread so a test can wait for one with a deadline."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(process,), daemon=True)
        self._thread.start()

    def _read(self, process: subprocess.Popen) -> None:
        for line in process.stdout:
            self.lines.append(line)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def wait_for(self, marker: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.text:
            assert time.monotonic() < deadline, f"no {marker!r} within {timeout_s}s:\n{self.text[-3000:]}"
            assert self._thread.is_alive(), f"the process ended before {marker!r}:\n{self.text[-3000:]}"
            time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
def test_make_run_streams_through_envoy_restarts_a_killed_engine_and_ctrl_c_stops_everything(tmp_path):
    names = "envoy envoy-admin edge orchestrator router cassandra otlp"
    metrics = "orchestrator-metrics router-metrics edge-metrics"
    flags = [
        f"--{name}-port" for name in (*names.split(), *metrics.split(), "cassandra-storage", "cassandra-jmx")
    ]
    argv = [sys.executable, "-m", "localmesh.mesh", "--engines", "2", "--run-dir", str(tmp_path / "run")]
    argv += [part for flag in flags for part in (flag, str(free_port()))]
    # Two engines of the primary pool, then the cheaper pool's, the completion pool's (Gemma 3) and the
    # embedding pool's (all-MiniLM-L6-v2).
    argv += ["--first-engine-port", str(free_consecutive_ports(5))]
    argv += ["--first-engine-metrics-port", str(free_consecutive_ports(5))]
    mesh = subprocess.Popen(
        argv,
        cwd=REPO_ROOT,
        env={**os.environ, DIR_ENV: str(tmp_path / "dev-jwt"), "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    output = Output(mesh)
    try:
        output.wait_for("Press Ctrl-C to stop everything.", timeout_s=300)
        printed = output.text
        token = re.search(r"export TOKEN=(\S+)", printed).group(1)
        result = run_printed_commands(printed, token)
        assert result.returncode == 0, result.stderr
        # Each example streamed the real model's greedy answer through Envoy: completions, the stored
        # chat's SSE, and the gRPC client.
        completion, _, rest = result.stdout.partition("data: [DONE]")
        stored, _, grpc_client = rest.rpartition("event: done")
        # A completion's chunks follow the router's frames, which merge tokens a busy reader has not taken
        # yet, and the chat's stream merges the deltas waiting when it is behind: the answer is their
        # text together.
        answer = "".join(
            json.loads(chunk)["choices"][0]["delta"].get("content", "")
            for chunk in re.findall(r"^data: (\{.*\})$", completion, re.MULTILINE)
        )
        assert " Paris" in answer and rest, completion
        stored_answer = "".join(
            json.loads(delta)["text"]
            for delta in re.findall(r"^event: delta\ndata: (\{.*\})$", stored, re.MULTILINE)
        )
        assert " Paris" in stored_answer, stored
        assert "Paris" in grpc_client and "FINISH_REASON_STOP" in grpc_client, grpc_client
        # Both models, each with its kind and licence; Gemma 3 completes a prompt through Envoy.
        envoy = re.search(r"(http://127\.0\.0\.1:\d+)/v1/chat/completions", printed).group(1)
        # Retries as the SDK makes them: Gemma's one-thread engine may be past the TTFT objective a moment.
        sdk = openai.OpenAI(base_url=f"{envoy}/v1", api_key=token, max_retries=4)
        kinds = {model.id: model.model_dump()["kind"] for model in sdk.models.list().data}
        assert sorted(kinds.values()) == ["chat", "chat", "completion"], kinds
        [gemma] = [name for name, kind in kinds.items() if kind == "completion"]
        completed = sdk.completions.create(
            model=gemma, prompt="Q: What is the capital of France?\nA:", max_tokens=8, temperature=0
        )
        assert "Paris" in completed.choices[0].text, completed
        # The embedding pool answers /v1/embeddings through Envoy.
        embedded = sdk.embeddings.create(model="all-MiniLM-L6-v2", input=["Paris", "the capital of France"])
        assert [len(d.embedding) for d in embedded.data] == [384, 384] and embedded.usage.prompt_tokens > 4

        # Every printed /metrics endpoint answers with its service's metrics; the printed operations page
        # URL signs an operator in, whose token the ops API accepts; the answers above left their spans.
        endpoints = dict(re.findall(r"^  ([\w-]+): +(http://\S+)$", output.text, re.MULTILINE))
        assert set(endpoints) == {
            "engine-0",
            "engine-1",
            "engine-2",
            "engine-3",
            "engine-4",
            "router",
            "orchestrator",
            "edge",
            "envoy",
        }, output.text
        expected = {f"engine-{i}": "gen_ai_server_" for i in range(5)}
        expected |= {"router": "chatmesh_router_", "envoy": "envoy_"}
        expected |= {"orchestrator": "chatmesh_orchestrator_", "edge": "chatmesh_edge_"}
        for name, url in endpoints.items():
            assert expected[name] in httpx.get(url, timeout=10).text, name
        ops_url, operator = re.search(r"(http://\S+/ops)#token=(\S+)", output.text).groups()
        assert "chatmesh operations" in httpx.get(ops_url).text
        overview = httpx.get(
            ops_url.replace("/ops", "/v1/ops/overview"), headers={"Authorization": f"Bearer {operator}"}
        )
        assert overview.status_code == 200 and overview.json()["engines"][0]["engine"] == "engine-0"
        spans = Path(re.search(r"Traces: (\S+)", output.text).group(1))
        wait_for(  # Envoy exports its spans every few seconds
            lambda: '"service": "envoy"' in spans.read_text() and '"service": "engine"' in spans.read_text(),
            timeout_s=30,
            what="Envoy's and the engine's spans in the span file",
        )

        # kill -9 of an engine: the mesh keeps answering on the primary pool's other one and restarts it.
        engine = int(re.search(r"engine-0 ready .* pid (\d+)", output.text).group(1))
        os.kill(engine, signal.SIGKILL)
        output.wait_for("engine-0 exited with code -9; restarting it in 1s", timeout_s=30)
        again = run_printed_commands(printed, token)
        assert again.returncode == 0, again.stderr
        assert again.stdout.count("Paris") == result.stdout.count("Paris"), again.stdout
        output.wait_for("engine-0 ready again", timeout_s=240)
    finally:
        # Ctrl-C: the terminal sends SIGINT to the foreground process group.
        os.killpg(mesh.pid, signal.SIGINT)
        code = mesh.wait(timeout=120)
    services = [int(pid) for pid in re.findall(r"ready .* pid (\d+)", output.text)]
    # cassandra, span collector, two engines, the cheaper pool's engine, the completion pool's, the
    # embedding pool's, router, orchestrator, edge, envoy, the restarted engine
    assert len(services) == 12
    assert code == 0, output.text[-3000:]
    assert "stopping chatmesh" in output.text
    assert [pid for pid in services if _alive(pid)] == []
