"""Where one request goes: its engine pool, admission by tier, then the placement policy.

This is the glue between the live state (registry, index, loads) and the pure decisions in
``policy`` and ``admission``. A request's pool is the engines serving its model with its tokenizer;
of those, the healthy ones not already tried are the candidates; admission narrows them by tier; the
policy picks one from each candidate's cached prefix (from the index, hashed with that engine's block
size and seed, plus the session's hint when the index has not heard yet: router/sessions.py) and its load.

A free request its pool refuses is *degraded* when the router has a cheaper model for its model
(``--degrade MODEL=CHEAPER``): it goes to the cheaper model's pool, which takes it while any of its
engines has headroom (the pool exists for it: its bound, not the free depth) and a predicted wait that
fits the request's objective, and is shed only when that pool is saturated too. Paid
tiers are never degraded. Every step reads the registry's ``LoadTable`` columns, so a decision
costs a few vector operations however many engines there are (bench/bench_scale_sim.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import grpc
import numpy as np

from chatmesh.block_hash import block_hashes
from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import TIERS, tier_of_proto
from router import admission
from router.config import RouterConfig
from router.embeds import embeds
from router.engines import EngineState
from router.index import PrefixIndex
from router.loads import LoadTable
from router.metrics import RouterMetrics
from router.policy import Choice, Pool, choose_in, predicted_cached_tokens, with_hint
from router.sessions import SessionHints, SessionsHeld


class PlacementState(Protocol):
    """What placement reads of a router's registry: the real one, or a simulated router's (bench/sim)."""

    index: PrefixIndex
    loads: LoadTable[EngineState]

    def engines(self) -> list[EngineState]: ...


@dataclass
class RequestPlan:
    """What placement needs to know about a request."""

    request_id: str
    # The prompt's token ids (an array('I') in the service: 4 bytes a token, a list of ints takes ~36).
    prompt: Sequence[int]
    model: str = ""
    tokenizer_fingerprint: str = ""
    tier: int = router_pb2.TIER_FREE
    session_id: str = ""
    opens_session: bool = (
        False  # its prompt carries no earlier turn of the session (GenerateStart.new_session)
    )
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
    model: str  # the pool's model: the request's, or the cheaper one it was degraded to
    degraded: bool = False


class Placer:
    def __init__(
        self,
        registry: PlacementState,
        config: RouterConfig,
        metrics: RouterMetrics,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registry = registry
        self.config = config
        self.metrics = metrics
        self.rng = rng or random.Random()
        self._turn = 0  # decisions made: round_robin's position
        self._decisions = metrics.decisions.labels(config.policy)
        self._cheaper = config.cheaper_models()
        self.hints = SessionHints(config.session_hints)
        self.sessions = SessionsHeld(config.session_idle_s)
        # Derived from the load table, valid while its version stands: (model, tokenizer fingerprint) ->
        # that pool's healthy rows, and queue-count cap -> every slot's queue limit.
        self._pools: dict[tuple[str, str], tuple[int, np.ndarray]] = {}
        self._limits: dict[int, tuple[int, np.ndarray]] = {}
        # Within one decision: (block size, seed) -> the index's cached prefix for every slot, so that
        # the long way after a refused quick pick does not walk the index again.
        self._depths: dict[tuple[int, int], np.ndarray] = {}
        self.clock = clock

    def place(self, plan: RequestPlan, exclude: set[str], admit: bool) -> Placement:
        """Picks an engine for ``plan``, not one of ``exclude``. ``admit``: apply the tier's admission
        rule (a new request), degrading a free one its pool refuses; otherwise (a failover) any engine
        of its pool with headroom will do."""
        self.sessions.expire(self.clock())
        self._depths.clear()  # the index may have changed since the last decision
        model = self._model_of(plan)
        rows = self._healthy_rows(plan, model, exclude)
        tier = tier_of_proto(plan.tier)
        cap = plan.tier if admit else router_pb2.TIER_ENTERPRISE  # whose queue-count cap applies
        objective = self.config.objective_s(tier.name, admit)
        quick = self._pick_if_admitted(plan, rows, model, cap, tier.rank, objective)
        if quick is not None:
            return quick
        allowed = self._admissible(plan, rows, cap, tier.rank, objective)
        if allowed.any():
            return self._choose(plan, rows[allowed], model)
        cheaper = self._cheaper.get(model) if admit and not admission.is_premium(plan.tier) else None
        cheaper_rows = self._pool_rows(cheaper, plan.tokenizer_fingerprint, exclude) if cheaper else rows[:0]
        # The cheaper pool exists for the requests degraded to it: any engine with headroom takes one
        # (whose predicted wait fits the request's own objective).
        cheaper_cap = router_pb2.TIER_ENTERPRISE
        cheaper_allowed = self._admissible(plan, cheaper_rows, cheaper_cap, tier.rank, objective)
        if cheaper and cheaper_allowed.any():
            self.metrics.degraded.labels(model, cheaper).inc()
            return self._choose(plan, cheaper_rows[cheaper_allowed], cheaper, degraded=True)
        self.metrics.shed.labels(tier.name).inc()
        retry_after = self._retry_after_s(plan, rows, cap, tier.rank, objective)
        if len(cheaper_rows):
            retry_after = min(
                retry_after, self._retry_after_s(plan, cheaper_rows, cheaper_cap, tier.rank, objective)
            )
        raise ServiceError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"every engine is overloaded for the {tier.name} tier; retry later",
            retry_after,
        )

    def _queues(self, plan: RequestPlan, rows: np.ndarray, rank: int, pool: np.ndarray) -> admission.Queues:
        """The rows' queues as ``plan``, a request of tier ``rank``, sees them; ``pool``: the rows of
        its pool it may go to (where its prompt is cached deepest counts)."""
        loads = self.registry.loads
        cached, block_sizes = self._cached_blocks(plan, rows)
        pool_cached, pool_block_sizes = self._cached_blocks(plan, pool)
        return admission.Queues(
            loads.waiting[rows],
            loads.max_waiting[rows],
            loads.ahead[rows, rank],
            loads.drain_rate[rows],
            loads.head_ttft_s[rows],
            loads.higher_rate[rows, rank],
            admission.Steps(
                loads.step_budget[rows],
                loads.step_fixed_s[rows],
                loads.step_token_s[rows],
                loads.decoding[rows],
                loads.prefill_pending[rows],
                loads.prefill_ahead[rows, rank],
                loads.prefill_ahead[rows, rank + 1 :],
                loads.ttft_margin_s[rows],
            ),
            own_prefill=len(plan.prompt) - cached * block_sizes,
            shortest_prefill=max(1, len(plan.prompt) - int((pool_cached * pool_block_sizes).max(initial=0))),
            higher_objectives_s=tuple(self.config.ttft_objective_s[name] for name in TIERS[rank + 1 :]),
        )

    def _may_keep_waiting(self, rows: np.ndarray) -> np.ndarray:
        """Which ``rows`` can keep a new request from its first token beyond its own prefill: engines
        with a queue, and engines that report their step time with anything running or pending (the
        step in progress and the prefill ahead). Only those are asked the wait rule (usually few: the
        rest need no more columns read)."""
        loads = self.registry.loads
        stepping = (loads.step_budget[rows] > 0) & (loads.decoding[rows] + loads.prefill_pending[rows] > 0)
        return (loads.waiting[rows] > 0) | stepping

    def _admissible(
        self,
        plan: RequestPlan,
        rows: np.ndarray,
        cap: int,
        rank: int,
        objective: float | None,
        pool: np.ndarray | None = None,
    ) -> np.ndarray:
        """Which ``rows`` take ``plan``: under ``cap``'s queue depth, its wait fitting ``objective``.
        ``pool``: the rows it may go to, when more than ``rows``."""
        limit = self._limit_column(cap)[rows]
        allowed = self.registry.loads.waiting[rows] < limit
        asked = (allowed & self._may_keep_waiting(rows)).nonzero()[0]
        if len(asked) and objective is not None:
            allowed[asked] = admission.admissible_rows(
                self._queues(plan, rows[asked], rank, rows if pool is None else pool),
                limit[asked],
                objective,
            )
        return allowed

    def _retry_after_s(
        self, plan: RequestPlan, rows: np.ndarray, cap: int, rank: int, objective: float | None
    ) -> float:
        limit = self._limit_column(cap)[rows]
        return admission.retry_after_rows(self._queues(plan, rows, rank, rows), limit, objective)

    def _limit_column(self, cap: int) -> np.ndarray:
        """Every slot's queue depth at which it stops taking requests under ``cap``'s count rule."""
        loads = self.registry.loads
        cached = self._limits.get(cap)
        if cached is None or cached[0] != loads.version:
            limit = admission.limits(loads.max_waiting, cap, self.config.free_queue_fraction)
            cached = self._limits[cap] = (loads.version, limit)
        return cached[1]

    def _pick_if_admitted(
        self, plan: RequestPlan, rows: np.ndarray, model: str, cap: int, rank: int, objective: float | None
    ) -> Placement | None:
        """The policy's pick among all healthy ``rows`` when admission takes it; None: decide the long
        way (admission first). The same pick, for a tenth of the work at 1,000 engines: with kv_aware at
        temperature 0 or the oracle, a pick that admission takes is also the pick among the admitted
        rows alone (it is as cheap as any of fewer rows, and a tie-break over a subset that holds it
        keeps it; a random one stays uniform over the admitted tied rows), so admission is asked of one
        engine instead of every engine with a queue. Not when a session hint could credit blocks: whether
        it does depends on which other candidates are admitted."""
        if self.config.policy not in ("kv_aware", "oracle") or self.config.weights.temperature > 0:
            return None
        pool = self._candidates(plan, rows)
        hint = self._hint_of(plan, pool)
        if hint is not None and hint[1] > pool.cached_blocks[hint[0]]:
            return None
        choice = self._policy_choice(plan, pool)
        row = self.registry.index.slot(choice.engine_id)
        if not self._admits(plan, row, rows, cap, rank, objective):
            return None
        return self._placed(plan, choice, model, False)

    def _admits(
        self, plan: RequestPlan, row: int, pool: np.ndarray, cap: int, rank: int, objective: float | None
    ) -> bool:
        """``_admissible`` for one row. An engine that cannot keep the request waiting takes it if its
        cap lets anything wait (most engines, most of the time: a few numbers read, no column built)."""
        one = np.array([row])
        if not self._may_keep_waiting(one)[0]:
            return bool(self._limit_column(cap)[row] > 0)
        return bool(self._admissible(plan, one, cap, rank, objective, pool)[0])

    def _choose(self, plan: RequestPlan, rows: np.ndarray, model: str, degraded: bool = False) -> Placement:
        """The policy's pick among admitted ``rows``."""
        candidates = self._candidates(plan, rows)
        hinted = self._hinted(plan, candidates)
        if hinted is not candidates:
            self.metrics.hinted.inc()
        return self._placed(plan, self._policy_choice(plan, hinted), model, degraded)

    def _policy_choice(self, plan: RequestPlan, pool: Pool) -> Choice:
        return choose_in(
            self.config.policy,
            len(plan.prompt),
            pool,
            self.config.weights,
            plan.session_id,
            self.rng,
            self._turn,
        )

    def _placed(self, plan: RequestPlan, choice: Choice, model: str, degraded: bool) -> Placement:
        """The decision made: counted, the session held there."""
        self._turn += 1
        self._decisions.inc()
        engine = self.registry.loads.states[self.registry.index.slot(choice.engine_id)]
        assert engine is not None, "a chosen row belongs to an attached engine"
        self.sessions.placed(plan.session_id, engine, self.clock())
        predicted = predicted_cached_tokens(len(plan.prompt), choice.cached_blocks, engine.block_size)
        return Placement(engine, predicted, model, degraded)

    def remember(self, plan: RequestPlan, engine: EngineState, output: Sequence[int]) -> None:
        """``plan``'s run finished on ``engine`` with ``output``: remember where its session's context
        is cached. The engine computed the prompt and every output token but the last (sampled, never
        fed back), so their full blocks are what it holds."""
        if not plan.session_id or not self.hints.capacity or engine.info is None:
            return
        block_size, seed = engine.info.block_size, engine.info.block_hash_seed
        prompt_hashes = plan.block_hashes(block_size, seed)
        computed = [*plan.prompt[len(prompt_hashes) * block_size :], *output[:-1]]
        whole = len(computed) - len(computed) % block_size
        parent = prompt_hashes[-1] if prompt_hashes else None
        answer_hashes = block_hashes(computed[:whole], block_size, seed, parent)
        self.hints.remember(
            plan.session_id, engine.engine_id, prompt_hashes + answer_hashes, len(prompt_hashes)
        )

    def _hinted(self, plan: RequestPlan, pool: Pool) -> Pool:
        """``pool`` with the session's hint applied (``policy.with_hint``), if it names a candidate."""
        hint = self._hint_of(plan, pool)
        if hint is None:
            return pool
        credited = with_hint(pool.cached_blocks, *hint)
        return pool if credited is pool.cached_blocks else replace(pool, cached_blocks=credited)

    def _hint_of(self, plan: RequestPlan, pool: Pool) -> tuple[int, int] | None:
        """The session's hint as (its engine's position in ``pool``, the blocks it vouches for there),
        if it names a candidate."""
        hint = self.hints.get(plan.session_id)
        if hint is None:
            return None
        try:
            row = self.registry.index.slot(hint.engine_id)  # an engine's load-table row is its slot
        except KeyError:  # gone since
            return None
        at = (pool.rows == row).nonzero()[0]
        if not len(at):  # not a candidate: unhealthy, not admitted, tried already, or another pool
            return None
        loads = self.registry.loads
        block_size, seed = loads.hashing_of(int(loads.hashing[row]))
        return int(at[0]), hint.vouched_blocks(plan.block_hashes(block_size, seed))

    def _model_of(self, plan: RequestPlan) -> str:
        """The model asked for: the plan's, the router's default, or the only one served ("" if none)."""
        model = plan.model or self.config.default_model
        if not model and len(served := self.registry.loads.models()) == 1:
            model = next(iter(served))
        return model

    def _pool_rows(self, model: str, tokenizer_fingerprint: str, exclude: set[str]) -> np.ndarray:
        """The load-table rows of a model's pool that are healthy and not excluded, in engine-id order."""
        loads = self.registry.loads
        cached = self._pools.get((model, tokenizer_fingerprint))
        if cached is not None and cached[0] == loads.version:
            rows = cached[1]
        else:
            usable = loads.pool_mask(model, tokenizer_fingerprint) & loads.healthy
            rows = loads.order[usable[loads.order]]
            if len(rows):  # only pools that exist: a request can name any model
                self._pools[(model, tokenizer_fingerprint)] = (loads.version, rows)
        if exclude:
            rows = rows[~np.isin(loads.engine_ids[rows], list(exclude))]
        return rows

    def _healthy_rows(self, plan: RequestPlan, model: str, exclude: set[str]) -> np.ndarray:
        """The request's pool's usable rows; none raises what is wrong with the pool."""
        rows = self._pool_rows(model, plan.tokenizer_fingerprint, exclude)
        if not len(rows):
            self.pool(plan)  # raises what is wrong with the request's pool, if anything is
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self._nothing_healthy(plan, exclude))
        return rows

    def _cached_blocks(self, plan: RequestPlan, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray | int]:
        """Each row's cached prefix of ``plan``'s prompt in blocks, and its block size (one number for
        the usual pool of one block size and seed)."""
        loads = self.registry.loads
        hashing = None if loads.one_hashing else loads.hashing[rows]
        if hashing is None or (hashing == hashing[0]).all():
            group = int(loads.hashing[rows[0]])
            return self._depth(plan, group)[rows], loads.hashing_of(group)[0]
        cached = np.zeros(len(rows), dtype=np.int64)
        for group in np.unique(hashing):
            depth = self._depth(plan, int(group))
            same = hashing == group
            cached[same] = depth[rows[same]]
        return cached, loads.block_size[rows]

    def _candidates(self, plan: RequestPlan, rows: np.ndarray) -> Pool:
        """The rows' columns with each engine's cached prefix, hashed with its block size and seed."""
        loads = self.registry.loads
        cached, block_sizes = self._cached_blocks(plan, rows)
        return Pool(
            rows,
            loads.engine_ids,
            loads.rendezvous_key,
            block_sizes,
            cached,
            loads.decode_blocks[rows],
            loads.sessions[rows] if plan.opens_session else 0,
        )

    def _depth(self, plan: RequestPlan, hashing: int) -> np.ndarray:
        """How many leading blocks of ``plan``'s prompt each slot's engine caches, for one hashing."""
        key = self.registry.loads.hashing_of(hashing)
        if key not in self._depths:
            self._depths[key] = self.registry.index.leading_blocks(
                plan.block_hashes(*key), self.registry.loads.capacity
            )
        return self._depths[key]

    def pool(self, plan: RequestPlan) -> list[EngineState]:
        """The engines serving the request's model with its tokenizer, healthy or not."""
        everyone = self.registry.engines()
        if not everyone:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "no engines are configured: start the router with --engine host:port or --engine-dns host:port",
            )
        everyone = [e for e in everyone if not embeds(e)]  # embedding engines generate nothing
        known = [e for e in everyone if e.info is not None]
        served = sorted({e.info.model for e in known if e.info is not None})
        model = plan.model or self.config.default_model
        if not model and len(served) > 1:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"this router serves several models ({', '.join(served)}): name one in `model`",
            )
        pool = [e for e in known if e.info is not None and (not model or e.info.model == model)]
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
            pool = [
                e
                for e in pool
                if e.info is not None and e.info.tokenizer_fingerprint == plan.tokenizer_fingerprint
            ]
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
