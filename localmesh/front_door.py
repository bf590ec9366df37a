"""The front door of the local mesh (``make run``): the edge and Envoy, and what to tell the person.

``front_door_specs`` renders and validates Envoy's config into the run directory and returns the launcher
specs for the edge and Envoy (in that order; Envoy health-checks the edge). The edge reaches each
orchestrator replica itself, as the Helm chart's does: every call and answer many to a stream on its
completion links, a chat's on its chat's replica.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import urlparse

from localmesh.dev_jwt import ISSUER, DevKeys, generate_keys
from meshkit.envoy import EnvoyConfig, envoy_spec, write_config
from meshkit.launcher import HttpOk, ServiceSpec


@dataclass(frozen=True)
class FrontDoorPorts:
    envoy: int = 8080
    envoy_admin: int = 9901
    edge: int = 8081


def otlp_from_env() -> tuple[str, int] | None:
    """Envoy exports spans where the services do: OTEL_EXPORTER_OTLP_ENDPOINT (OTLP over gRPC)."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return None
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return parsed.hostname or "127.0.0.1", parsed.port or 4317


def _envoy_config(
    ports: FrontDoorPorts,
    orchestrator_ports: list[int],
    keys: DevKeys,
    otlp: tuple[str, int] | None = None,
    edge_dialed: int | None = None,
) -> EnvoyConfig:
    return EnvoyConfig(
        listen_port=ports.envoy,
        admin_port=ports.envoy_admin,
        jwks_path=keys.jwks_path,
        edge_endpoints=(("127.0.0.1", edge_dialed or ports.edge),),
        orchestrator_endpoints=tuple(("127.0.0.1", port) for port in orchestrator_ports),
        jwt_issuer=ISSUER,
        cors_origins=(f"http://127.0.0.1:{ports.envoy}", f"http://localhost:{ports.envoy}"),
        otlp=otlp or otlp_from_env(),
    )


def front_door_specs(
    ports: FrontDoorPorts,
    orchestrator_ports: list[int],
    run_dir: Path,
    keys: DevKeys,
    python: str = sys.executable,
    edge_flags: list[str] | None = None,
    otlp: tuple[str, int] | None = None,
    edge_dialed: int | None = None,
) -> list[ServiceSpec]:
    """``edge_flags``: more ``python -m edge`` flags; ``otlp``: where Envoy sends its spans (default:
    OTEL_EXPORTER_OTLP_ENDPOINT, else nowhere); ``edge_dialed``: the port Envoy dials for the edge when
    not the edge's own (a proxy in front of it)."""
    config = _envoy_config(ports, orchestrator_ports, keys, otlp, edge_dialed)
    config_path = write_config(config, run_dir / "envoy.yaml")
    edge = ServiceSpec(
        name="edge",
        argv=[
            python,
            "-m",
            "edge",
            "--port",
            str(ports.edge),
            "--orchestrator",
            ",".join(f"127.0.0.1:{port}" for port in orchestrator_ports),
            *(edge_flags or []),
            *keys.service_flags(),
        ],
        ports=(ports.edge,),
        ready=HttpOk(f"http://127.0.0.1:{ports.edge}/healthz"),
    )
    return [edge, envoy_spec(config, config_path)]


def welcome(ports: FrontDoorPorts, token: str, user: str, tier: str) -> str:
    """What `make run` prints once everything is healthy: where to go and how to call it."""
    base = f"http://127.0.0.1:{ports.envoy}"
    auth = "-H \"Authorization: Bearer $TOKEN\" -H 'Content-Type: application/json'"
    # A question with one right answer, greedy: the examples show the model answering, not sampling noise.
    # Asked bare, its first token is a near-tie that 8-bit and float32 activations break differently
    # (docs/benchmarks/engine.md, "int8 and greedy answers"); asked for one sentence, every kernel set answers Paris.
    question = "What is the capital of France? Answer in one sentence."
    completion = json.dumps(
        {"stream": True, "temperature": 0, "messages": [{"role": "user", "content": question}]}
    )
    message = json.dumps({"content": question, "options": {"temperature": 0}})
    return "\n".join(
        [
            f"  Chat in your browser:   {base}/#token={token}",
            f"  A token ({user}, {tier}):  export TOKEN={token}",
            "  Another token:          make token USER=bob TIER=free",
            "  Stream an answer (SSE, OpenAI-compatible):",
            f"    curl -N {base}/v1/chat/completions {auth} -d {shlex.quote(completion)}",
            "  Or with a stored chat:",
            f"    CHAT=$(curl -s -X POST {base}/v1/chats {auth} -d '{{}}' | python3 -c 'import json,sys; print(json.load(sys.stdin)[\"chat_id\"])')",
            f"    curl -N {base}/v1/chats/$CHAT/messages {auth} -d {shlex.quote(message)}",
            "  gRPC through Envoy:",
            f'    .venv/bin/python examples/grpc_client.py --target 127.0.0.1:{ports.envoy} --token "$TOKEN" '
            f"--temperature 0 {shlex.quote(question)}",
            f"  Envoy admin (stats, health): http://127.0.0.1:{ports.envoy_admin}/",
        ]
    )


def check() -> int:
    """``python -m localmesh.front_door`` (``make lint``): renders the local mesh's Envoy config, without and
    with OpenTelemetry, and has ``envoy --mode validate`` check both."""
    with tempfile.TemporaryDirectory() as tmp:
        keys = generate_keys(Path(tmp) / "keys")
        for otlp in (None, ("127.0.0.1", 4317)):
            ports = FrontDoorPorts()
            config = replace(_envoy_config(ports, [50050], keys), otlp=otlp)
            path = write_config(config, Path(tmp) / "envoy.yaml")
            print(
                f"the local Envoy config renders and validates ({'with' if otlp else 'without'} OpenTelemetry): {path}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(check())
