"""The front door as `make run` starts it (chatmesh.front_door), and the instructions it prints: the page
URL, the curl SSE examples and the gRPC example client all work as printed. The chat service behind it is
ScriptedChatService (not the orchestrator)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

import httpx
import pytest

from chatmesh.dev_jwt import DevKeys
from chatmesh.front_door import FrontDoorPorts, front_door_specs, welcome
from chatmesh.launcher import Launcher, PortInUseError, free_port
from tests.front_door.conftest import ScriptedFrontDoor

REPO_ROOT = Path(__file__).resolve().parents[2]


def fresh_ports() -> FrontDoorPorts:
    return FrontDoorPorts(
        envoy=free_port(), envoy_admin=free_port(), envoy_internal=free_port(), edge=free_port()
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

        commands = [line.strip() for line in text.splitlines() if line.startswith("    ")]
        assert len(commands) == 4  # curl completions, create chat, curl messages, gRPC client
        result = subprocess.run(
            ["bash", "-c", "set -euo pipefail\n" + "\n".join(commands)],
            env={**os.environ, "TOKEN": token},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
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
