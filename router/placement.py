"""Where one request goes: its engine pool, admission by tier, then the placement policy.

This is the glue between the live state (registry, index, loads) and the pure decisions in
``policy`` and ``admission``. A request's pool is the engines serving its model with its tokenizer;
of those, the healthy ones not already tried are the candidates; admission narrows them by tier; the
policy picks one from each candidate's cached prefix (from the index, hashed with that engine's block
size and seed) and its load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import grpc

from chatmesh.block_hash import block_hashes
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from router import admission
from router.config import RouterConfig
from router.engines import EngineState
from router.metrics import RouterMetrics
from router.policy import Candidate, choose, predicted_cached_tokens
from router.registry import EngineRegistry


@dataclass
class RequestPlan:
    """What placement needs to know about a request."""

    request_id: str
    prompt: list[int]
    model: str = ""
    tokenizer_fingerprint: str = ""
    tier: int = router_pb2.TIER_FREE
    session_id: str = ""
    _hashes: dict[tuple[int, int], list[int]] = field(default_factory=dict, repr=False)

    def block_hashes(self, block_size: int, seed: int) -> list[int]:
        """The prompt's chained block hashes for an engine pool's block size and seed (computed once)."""
        key = (block_size, seed)
        if key not in self._hashes:
            self._hashes[key] = block_hashes(self.prompt, block_size, seed)
        return self._hashes[key]


@dataclass(frozen=True)
class Placement:
    engine: EngineState
    predicted_cached_tokens: int


class Placer:
    def __init__(
        self,
        registry: EngineRegistry,
        config: RouterConfig,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._turn = 0  # decisions made: round_robin's position

    def place(self, plan: RequestPlan, exclude: set[str], admit: bool) -> Placement:
        """Picks an engine for ``plan``, not one of ``exclude``. ``admit``: apply the tier's admission
        rule (a new request); otherwise (a failover) any engine with headroom will do."""
        healthy = [e for e in self.pool(plan) if e.healthy and e.engine_id not in exclude]
        if not healthy:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self._nothing_healthy(plan, exclude))
        tier = plan.tier if admit else router_pb2.TIER_ENTERPRISE
        queues = [e.queue_view() for e in healthy]
        allowed = set(admission.admissible(queues, tier, self.config.free_queue_fraction))
        if not allowed:
            tier_name = tier_of_proto(plan.tier).name
            self.metrics.shed.labels(tier_name).inc()
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"every engine is overloaded for the {tier_name} tier; retry later",
                admission.retry_after_s(queues, tier, self.config.free_queue_fraction),
            )
        engines = {e.engine_id: e for e in healthy if e.engine_id in allowed}
        candidates = self._candidates(plan, list(engines.values()))
        choice = choose(
            self.config.policy,
            len(plan.prompt),
            candidates,
            self.config.weights,
            plan.session_id,
            self.rng,
            self._turn,
        )
        self._turn += 1
        self.metrics.decisions.labels(self.config.policy).inc()
        engine = engines[choice.engine_id]
        predicted = predicted_cached_tokens(len(plan.prompt), choice.cached_blocks, engine.block_size)
        return Placement(engine, predicted)

    def _candidates(self, plan: RequestPlan, engines: list[EngineState]) -> list[Candidate]:
        """Each engine's cached prefix of the prompt, hashed with that engine's block size and seed."""
        cached: dict[str, int] = {}
        groups: dict[tuple[int, int], list[str]] = {}
        for engine in engines:
            assert engine.info is not None
            groups.setdefault((engine.info.block_size, engine.info.block_hash_seed), []).append(
                engine.engine_id
            )
        for (block_size, seed), ids in groups.items():
            cached |= self.registry.index.match(plan.block_hashes(block_size, seed), ids)
        return [
            Candidate(e.engine_id, e.block_size, cached.get(e.engine_id, 0), e.decode_blocks())
            for e in engines
        ]

    def pool(self, plan: RequestPlan) -> list[EngineState]:
        """The engines serving the request's model with its tokenizer, healthy or not."""
        everyone = self.registry.engines()
        if not everyone:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "no engines are configured: start the router with --engine host:port or --engine-dns host:port",
            )
        known = [e for e in everyone if e.info is not None]
        served = sorted({e.info.model for e in known})
        model = plan.model or self.config.default_model
        if not model and len(served) > 1:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this router serves several models ({', '.join(served)}): name one in `model`",
            )
        pool = [e for e in known if not model or e.info.model == model]
        if not pool:
            if len(known) == len(everyone):
                raise ServiceError(
                    grpc.StatusCode.NOT_FOUND,
                    f"no engine serves model {model!r}; served: {', '.join(served) or 'none'}",
                )
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"no reachable engine serves {model or 'a model'} yet "
                f"({len(everyone) - len(known)} of {len(everyone)} engines not reached)",
            )
        if plan.tokenizer_fingerprint:
            pool = [e for e in pool if e.info.tokenizer_fingerprint == plan.tokenizer_fingerprint]
            if not pool:
                raise ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"no engine of {model or served[0]} uses tokenizer {plan.tokenizer_fingerprint!r}: "
                    "re-tokenize with the served model's tokenizer",
                )
        return pool

    @staticmethod
    def _nothing_healthy(plan: RequestPlan, exclude: set[str]) -> str:
        tried = f" (already tried: {', '.join(sorted(exclude))})" if exclude else ""
        return f"no healthy engine for {plan.model or 'the default model'} right now{tried}"
