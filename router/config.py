"""Router configuration: one dataclass whose settings are the ``python -m router`` flags (meshkit.config)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from chatmesh.tiers import TIERS, TTFT_OBJECTIVES_S
from meshkit.config import nested, setting
from router.admission import ADMISSION_RULES
from router.policy import POLICIES, CostWeights

_ADDRESS = re.compile(
    r"^(?:(?P<name>[A-Za-z0-9_.-]+)=)?(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(?P<port>\d+)$"
)


@dataclass(frozen=True)
class EngineAddress:
    """One configured engine: ``[name=]host:port``; the name defaults to the address."""

    engine_id: str
    address: str

    @classmethod
    def parse(cls, spec: str) -> EngineAddress:
        match = _ADDRESS.match(spec.strip())
        if match is None or not 0 < int(match["port"]) < 65536:
            raise ValueError(f"engine address must look like [name=]host:port, got {spec!r}")
        address = f"{match['host']}:{match['port']}"
        return cls(match["name"] or address, address)


def _engines(specs: list[str]) -> tuple[EngineAddress, ...]:
    return tuple(EngineAddress.parse(spec) for spec in specs)


def _degrades(specs: list[str]) -> tuple[tuple[str, str], ...]:
    pairs = []
    for spec in specs:
        model, sep, cheaper = spec.partition("=")
        if not sep or not model.strip() or not cheaper.strip():
            raise ValueError(f"--degrade must look like MODEL=CHEAPER_MODEL, got {spec!r}")
        pairs.append((model.strip(), cheaper.strip()))
    return tuple(pairs)


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[EngineAddress, ...] = setting(
        (),
        "engine [name=]host:port (repeat the flag for each engine)",
        flag="engine",
        flag_default=[],
        parse=_engines,
        repeat=True,
    )
    # host:port names re-resolved every dns_refresh_s; each address is an engine (Kubernetes headless Services).
    engine_dns: tuple[str, ...] = setting(
        (), "host:port whose addresses are all engines, re-resolved (repeatable)", parse=tuple, repeat=True
    )
    dns_refresh_s: float = setting(10.0, "how often --engine-dns names are resolved again")
    default_model: str = setting("", "model for requests that name none (empty: the only one served)")

    # Placement
    policy: str = setting("kv_aware", f"placement policy: {' | '.join(POLICIES)}")
    weights: CostWeights = nested(CostWeights)
    # Admission (router/admission.py): the count rule caps every queue (the free tier at this fraction of
    # its bound); the wait rule also asks each engine's predicted wait to fit the tier's TTFT objective.
    admission: str = setting("wait", f"admission rule: {' | '.join(ADMISSION_RULES)}")
    free_queue_fraction: float = setting(0.5, "free tier is shed when every queue is this full")
    ttft_objective_s: dict[str, float] = setting(
        default_factory=lambda: dict(TTFT_OBJECTIVES_S),
        help="{key} tier's time-to-first-token objective in seconds (admission by predicted wait)",
        flag="ttft-objective-{key}-s",
        per=TIERS,
    )
    # Degrade: a free request its model's pool refuses goes to that model's cheaper model instead.
    degrade: tuple[tuple[str, str], ...] = setting(
        (),
        "MODEL=CHEAPER: under load, free requests for MODEL go to CHEAPER's pool before being shed (repeatable)",
        flag_default=[],
        parse=_degrades,
        repeat=True,
    )

    # Session hints: each session's last engine, for turns that come before its KV events (router/sessions.py).
    session_hints: int = setting(
        100_000, "sessions whose last engine is remembered as a placement hint (0: off)"
    )
    # Sessions held (router/sessions.py): what a new session's placement weighs (policy.py).
    session_idle_s: float = setting(
        600.0, "a session counts as held by the engine of its latest request for this long after it"
    )

    # Engine streams and calls
    load_interval_ms: int = setting(100, "engine load report period")
    rpc_timeout_s: float = 5.0  # unary calls (GetModelInfo)
    accept_timeout_s: float = setting(10.0, "an engine must accept a request within this")
    first_token_timeout_s: float = setting(120.0, "first token after accept (queueing included)")
    idle_timeout_s: float = setting(30.0, "longest silence between two frames of a started stream")
    max_request_s: float = setting(3600.0, "deadline of an engine call when the client set none")
    max_attempts: int = setting(3, "placements per request: the first one plus failovers")
    index_max_blocks_per_engine: int = setting(
        1 << 20, "bound on indexed blocks per engine (also capped by the engine's pool size)"
    )

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.admission not in ADMISSION_RULES:
            problems.append(f"admission must be one of {', '.join(ADMISSION_RULES)}, got {self.admission!r}")
        if not 0 < self.free_queue_fraction <= 1:
            problems.append("free queue fraction must be in (0, 1]")
        if min(self.ttft_objective_s.values()) <= 0:
            problems.append("TTFT objectives must be > 0 seconds")
        if self.max_attempts < 1:
            problems.append("max attempts must be >= 1")
        if self.session_hints < 0:
            problems.append("session hints must be >= 0")
        if min(self.weights.overlap, self.weights.temperature, self.weights.session) < 0:
            problems.append("the overlap and session weights and the temperature must be >= 0")
        if self.session_idle_s <= 0:
            problems.append("the session idle time must be > 0 seconds")
        timeouts = (
            self.dns_refresh_s,
            self.rpc_timeout_s,
            self.accept_timeout_s,
            self.first_token_timeout_s,
            self.idle_timeout_s,
            self.max_request_s,
        )
        if min(timeouts) <= 0 or self.load_interval_ms < 10 or self.index_max_blocks_per_engine <= 0:
            problems.append("timeouts and the index bound must be positive, the load interval >= 10 ms")
        ids = [engine.engine_id for engine in self.engines]
        if len(set(ids)) != len(ids):
            problems.append(f"engine names must be unique, got {', '.join(ids)}")
        cheaper = self.cheaper_models()
        if len(cheaper) != len(self.degrade) or any(model in cheaper for model in cheaper.values()):
            problems.append("--degrade names each model once, and a cheaper model degrades no further")
        for name in self.engine_dns:
            if EngineAddress.parse(name).engine_id != name:
                problems.append(f"--engine-dns takes host:port without a name, got {name!r}")
        if problems:
            raise ValueError("invalid router configuration: " + "; ".join(problems))

    def cheaper_models(self) -> dict[str, str]:
        """Each degradable model's cheaper model (``--degrade``)."""
        return dict(self.degrade)

    def objective_s(self, tier: str, admit: bool) -> float | None:
        """The TTFT objective admission holds a request of ``tier`` to; None: the count rule alone (the
        count rule configured, or a failover, which continues a stream wherever there is room)."""
        return self.ttft_objective_s[tier] if admit and self.admission == "wait" else None
