"""Router configuration: one dataclass, filled from the ``python -m router`` flags (see ``__main__``)."""

from __future__ import annotations

import re
from argparse import Namespace
from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class RouterConfig:
    engines: tuple[EngineAddress, ...] = ()
    # host:port names re-resolved every dns_refresh_s; each address is an engine (Kubernetes headless Services).
    engine_dns: tuple[str, ...] = ()
    dns_refresh_s: float = 10.0
    default_model: str = ""  # for requests that name none; empty: the only model served

    # Placement
    policy: str = "kv_aware"
    weights: CostWeights = field(default_factory=CostWeights)
    # Admission: the free tier is shed when every engine's queue is at least this fraction of its bound.
    free_queue_fraction: float = 0.5

    # Engine streams and calls
    load_interval_ms: int = 100  # WatchLoad period asked of engines
    rpc_timeout_s: float = 5.0  # unary calls (GetModelInfo)
    accept_timeout_s: float = 10.0  # Generate: from dispatch to the engine's `accepted`
    first_token_timeout_s: float = 120.0  # from `accepted` to the first token (queueing included)
    idle_timeout_s: float = 30.0  # between two frames of a stream that has started
    max_request_s: float = 3600.0  # deadline of one engine Generate call when the client set none
    max_attempts: int = 3  # placements of one request: the first plus failovers
    index_max_blocks_per_engine: int = 1 << 20  # index memory bound (also capped by the engine's pool size)

    def __post_init__(self) -> None:
        problems = []
        if self.policy not in POLICIES:
            problems.append(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 < self.free_queue_fraction <= 1:
            problems.append("free queue fraction must be in (0, 1]")
        if self.max_attempts < 1:
            problems.append("max attempts must be >= 1")
        if self.weights.overlap < 0 or self.weights.temperature < 0:
            problems.append("the overlap weight and the temperature must be >= 0")
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
        for name in self.engine_dns:
            if EngineAddress.parse(name).engine_id != name:
                problems.append(f"--engine-dns takes host:port without a name, got {name!r}")
        if problems:
            raise ValueError("invalid router configuration: " + "; ".join(problems))

    @classmethod
    def from_args(cls, args: Namespace) -> RouterConfig:
        return cls(
            engines=tuple(EngineAddress.parse(spec) for spec in args.engine),
            engine_dns=tuple(args.engine_dns),
            dns_refresh_s=args.dns_refresh_s,
            default_model=args.default_model,
            policy=args.policy,
            weights=CostWeights(overlap=args.overlap_weight, temperature=args.temperature),
            free_queue_fraction=args.free_queue_fraction,
            load_interval_ms=args.load_interval_ms,
            accept_timeout_s=args.accept_timeout_s,
            first_token_timeout_s=args.first_token_timeout_s,
            idle_timeout_s=args.idle_timeout_s,
            max_request_s=args.max_request_s,
            max_attempts=args.max_attempts,
            index_max_blocks_per_engine=args.index_max_blocks_per_engine,
        )
