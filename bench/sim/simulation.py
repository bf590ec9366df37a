"""The discrete-event loop: simulated users and engines around the real router code.

Each router replica is the router's own placement state: a ``PrefixIndex`` fed by every engine's KV
events, an ``EngineState`` per engine fed by the engine's periodic load reports and by the replica's own
dispatches, and a ``Placer`` making every decision (pool, health, admission by tier, the policy) — the
code ``python -m router`` runs, minus gRPC. Requests go to the replicas in turn (as the orchestrators'
connections spread them); every replica ingests every engine's events (the fan-out a real deployment
has), so the replicas' indexes stay identical.

KV events reach every replica ``event_lag_s`` after the engine published them (in order), as a real
router hears them over its streams; a chat's next turn that comes sooner finds the index without its
last answer, and the replica that finished the previous turn has its session hint (router/sessions.py:
the sim records the blocks the engine cached, as the relay records the blocks it saw computed).

Time is virtual for everything simulated (users, engines, event delivery, load reports every
``load_interval_s``); the router's own work is timed with the real clock: every ``Placer.place`` call
(the µs per decision) and every index update (ingestion).
"""

from __future__ import annotations

import heapq
import itertools
import random
import time
from collections.abc import Callable

import grpc
from prometheus_client import CollectorRegistry

from bench.sim.engine import Request, SimEngine
from bench.sim.report import Report
from bench.sim.setup import Setup
from bench.sim.workload import Chat, Conversations
from chatmesh.block_hash import BLOCK_HASH_SEED
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.tiers import tier_of_proto
from router.config import RouterConfig
from router.engines import EngineState
from router.index import PrefixIndex
from router.loads import LoadTable
from router.metrics import RouterMetrics
from router.placement import Placer, RequestPlan

MODEL = "sim"


class RouterReplica:
    """One router's placement state: ``engines()``, ``index`` and ``loads`` are what ``Placer`` reads of
    its registry."""

    def __init__(self, setup: Setup, engine_ids: list[str], seed: int, clock: Callable[[], float]) -> None:
        self.index = PrefixIndex()
        self.loads: LoadTable[EngineState] = LoadTable()
        info = engine_pb2.GetModelInfoResponse(
            model=MODEL, block_size=setup.costs.block_size, block_hash_seed=BLOCK_HASH_SEED
        )
        self.states: dict[str, EngineState] = {}
        for engine_id in engine_ids:
            # A simulated engine is never called over gRPC: placement reads only its state.
            # Its clock is the simulation's: drain rates and first-token times are in simulated seconds.
            state = EngineState(
                engine_id,
                engine_id,
                channel=None,  # type: ignore[arg-type]
                stub=None,  # type: ignore[arg-type]
                info=info,
                connected=True,
                clock=clock,
            )
            self.states[engine_id] = state
            self.index.add_engine(engine_id, setup.costs.kv_blocks)
            state.attach(self.loads, self.index.slot(engine_id))
        self._sorted = sorted(self.states.values(), key=lambda s: s.engine_id)
        config = RouterConfig(
            policy=setup.policy, session_hints=setup.session_hints, admission=setup.admission
        )
        self.placer = Placer(self, config, RouterMetrics(CollectorRegistry()), random.Random(seed), clock)
        self.ingest_s = 0.0
        self.ingested_blocks = 0
        self.ingested_events = 0

    def engines(self) -> list[EngineState]:
        return self._sorted

    def hinted_placements(self) -> int:
        """Placements whose session hint credited blocks this replica's index had not heard of."""
        value = self.placer.metrics.registry.get_sample_value(
            "chatmesh_router_session_hinted_placements_total"
        )
        return int(value or 0)

    def ingest(self, engine_id: str, stored: bool, hashes: list[int]) -> None:
        started = time.perf_counter()
        if stored:
            self.index.store(engine_id, hashes)
        else:
            self.index.remove(engine_id, hashes)
        self.ingest_s += time.perf_counter() - started
        self.ingested_blocks += len(hashes)
        self.ingested_events += 1


class Simulation:
    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[[float], None]]] = []
        self._tie = itertools.count()
        rng = random.Random(setup.workload.seed)
        self.rng = rng
        self.conversations = Conversations(setup.workload, setup.costs.block_size, rng)
        ids = self.engine_ids = [f"engine-{i:04d}" for i in range(setup.engines)]
        self.engines = {
            engine_id: SimEngine(
                engine_id,
                setup.costs,
                self.conversations.system_blocks,
                self._fan_out,
                self._at,
                self._first_token,
                self._finished,
            )
            for engine_id in ids
        }
        self.routers = [
            RouterReplica(setup, ids, setup.workload.seed + r, lambda: self.now) for r in range(setup.routers)
        ]
        self.ready: list[
            Chat
        ] = []  # chats done thinking, oldest first (a deque would do; list + index is faster)
        self._ready_head = 0
        self.report = Report(
            setup, measure_from=setup.measure_from_s if setup.measure_from_s >= 0 else setup.workload.ramp_s
        )
        self._requests = itertools.count()
        self.in_flight: dict[str, Request] = {}
        self._past = False  # events being published are a warm fleet's history (heard long ago)

    # -- the event loop -------------------------------------------------------------------------------

    def _at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self._queue, (when, next(self._tie), action))

    def run(self) -> Report:
        started = time.perf_counter()
        self._report_loads(0.0)
        self._at(0.0, self._arrival)
        self._at(self.setup.workload.duration_s, self._measure_index)
        if self.setup.fail_engine_at_s >= 0:
            self._at(self.setup.fail_engine_at_s, self._fail_engine)
        while self._queue:
            self.now, _, action = heapq.heappop(self._queue)
            action(self.now)
        sizes = [[r.index.size(e) for e in self.engines] for r in self.routers]
        self.report.finish(
            simulated_s=self.now,
            wall_s=time.perf_counter() - started,
            ingest=[(r.ingest_s, r.ingested_blocks, r.ingested_events) for r in self.routers],
            replicas_agree=all(s == sizes[0] for s in sizes),
            hinted=sum(r.hinted_placements() for r in self.routers),
        )
        return self.report

    def _measure_index(self, now: float) -> None:
        """The index at its fullest: when arrivals stop (walks every entry, outside the timed calls)."""
        index = self.routers[0].index
        self.report.index_bytes = index.footprint_bytes()
        self.report.indexed_blocks = sum(index.size(engine_id) for engine_id in self.engines)

    def _report_loads(self, now: float) -> None:
        """Every engine's load report reaches every replica (WatchLoad)."""
        for engine in self.engines.values():
            if engine.alive:
                load = engine.load()
                for router in self.routers:
                    router.states[engine.engine_id].report(load)
        if self.in_flight or now < self.setup.workload.duration_s:
            self._at(now + self.setup.load_interval_s, self._report_loads)

    def _fan_out(self, engine_id: str, stored: bool, hashes: list[int]) -> None:
        if self.setup.event_lag_s > 0 and not self._past:
            self._at(self.now + self.setup.event_lag_s, lambda _: self._deliver(engine_id, stored, hashes))
        else:
            self._deliver(engine_id, stored, hashes)

    def _deliver(self, engine_id: str, stored: bool, hashes: list[int]) -> None:
        for router in self.routers:
            router.ingest(engine_id, stored, hashes)

    # -- users ----------------------------------------------------------------------------------------

    def _arrival(self, now: float) -> None:
        rate = self.setup.workload.rate(now)
        if rate > 0:
            self._send(self._next_chat(now), now)
        if now < self.setup.workload.duration_s:
            wait = self.rng.expovariate(rate) if rate > 0 else 0.01
            self._at(now + wait, self._arrival)

    def _next_chat(self, now: float):
        if self._ready_head < len(self.ready):
            chat = self.ready[self._ready_head]
            self._ready_head += 1
            if self._ready_head > 4096:
                del self.ready[: self._ready_head]
                self._ready_head = 0
            return chat
        chat = self.conversations.new_chat()
        if self.setup.workload.warm_start:
            self._past = True
            self.engines[self.rng.choice(self.engine_ids)].adopt(chat)
            self._past = False
        return chat

    def _think(self, chat, now: float) -> None:
        if chat.turns_left <= 0:
            return
        self._at(
            now + self.rng.expovariate(1 / self.setup.workload.think_s), lambda _: self.ready.append(chat)
        )

    def _send(self, chat, now: float) -> None:
        self.conversations.add_user_message(chat)
        chat.turns_left -= 1
        serial = next(self._requests)
        request = Request(
            f"r{serial}",
            chat,
            chat.tier,
            now,
            chat.tokens,
            len(chat.hashes),
            self.conversations.answer_length(),
            replica=serial % len(self.routers),
        )
        self.report.arrived(request)
        self._place(request, now, exclude=set(), admit=True)

    def _place(self, request: Request, now: float, exclude: set[str], admit: bool) -> None:
        router = self.routers[request.replica]
        chat = request.chat
        plan = RequestPlan(
            request.request_id,
            [0] * request.prompt_tokens,  # only its length is read: the hashes are given below
            model=MODEL,
            tier=request.tier,
            session_id=_session_id(chat),
            opens_session=chat.turn == 1,  # a chat's first message: no earlier turn anywhere
            _hashes={(self.setup.costs.block_size, BLOCK_HASH_SEED): chat.hashes[: request.prompt_blocks]},
        )
        started = time.perf_counter()
        try:
            placement = router.placer.place(plan, exclude, admit)
        except ServiceError as refused:
            self.report.decision(time.perf_counter() - started)
            if refused.code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            self.report.shed(request)
            self._think(chat, now)  # the user sees "busy, retry later" and comes back
            return
        self.report.decision(time.perf_counter() - started)
        request.attempts += 1
        request.engine_id = placement.engine.engine_id
        request.predicted_cached_tokens = placement.predicted_cached_tokens
        placement.engine.dispatched(
            request.request_id, request.prompt_tokens, tier_of_proto(request.tier).rank
        )
        self.in_flight[request.request_id] = request
        self.report.streams(len(self.in_flight))
        self.engines[request.engine_id].submit(request, now)

    # -- engines --------------------------------------------------------------------------------------

    def _first_token(self, request: Request, now: float) -> None:
        if request.first_token < 0:  # after a failover the client already had its first token
            request.first_token = now
        state = self.routers[request.replica].states[request.engine_id]
        state.progressed(request.request_id, request.prompt_tokens + 1)

    def _finished(self, request: Request, now: float) -> None:
        request.finished = now
        self.routers[request.replica].states[request.engine_id].ended(request.request_id, completed=True)
        del self.in_flight[request.request_id]
        chat = request.chat
        self.conversations.add_answer(chat, request.answer_tokens)
        # What the relay records when `finished` passes through it: the engine now holds the whole context.
        hints = self.routers[request.replica].placer.hints
        hints.remember(_session_id(chat), request.engine_id, chat.hashes, request.prompt_blocks)
        self.report.finished(request)
        self._think(request.chat, now)

    def _fail_engine(self, now: float) -> None:
        """Engine 0 dies: every replica marks it unhealthy and drops its index entries (as the supervisor
        does when its streams break); its requests are re-placed elsewhere (the relay's failover)."""
        engine = next(iter(self.engines.values()))
        lost = engine.fail()
        for router in self.routers:
            router.states[engine.engine_id].disconnect()
            router.index.clear(engine.engine_id)
        for request in lost:
            self.routers[request.replica].states[engine.engine_id].ended(request.request_id, completed=False)
            del self.in_flight[request.request_id]
            self.report.failed_over(request)
            self._place(request, now, exclude={engine.engine_id}, admit=False)


def _session_id(chat: Chat) -> str:
    return f"chat-{chat.serial}"
