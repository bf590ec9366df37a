"""The router's view of one engine: what it serves, its last load report, its health, and the requests
this router has in flight there.

The engine's load report is periodic (and a request that just finished still counts in it); the
router's own bookkeeping is exact for its own requests. Placement combines them, like Dynamo's
predicted active blocks: load = this router's in-flight requests (each one's context so far in
blocks; those not started count as waiting until their first token, beyond the running slots the
engine's last report left free) plus the *foreign* load the last report showed beyond them (other
router replicas, direct clients), which is 0 with one router.

For admission by predicted wait (``router.admission``) it also keeps this router's queued requests by
tier rank, the rate at which its requests finish here, the rate at which it sends each tier here
(decaying with a time constant of ``ADMITTED_RATE_TAU_S``, so a tier that stops arriving stops
counting), and the engine's time to a first token for requests that found nothing queued (its
head-of-queue TTFT: prefill and first step, as seen from here). For an engine that reports its step
time it keeps, per tier rank, the prompt tokens of this router's requests there that have no first token
yet (beyond the prefix the index predicted cached), and the report's pending prompt tokens beyond them
(the foreign prefill): what a new request's prefill waits for; and how much later than predicted its
requests' first tokens came (the hops, the CPU the engine shares, the step model's own error): the
90th percentile of the last ``SAMPLES`` misses is the margin admission adds to every prediction there.
Times come from ``clock`` (the simulation passes its virtual one).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import grpc
import numpy as np

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.tiers import TIERS
from meshkit.links import Link, LinkMessages
from router.admission import QueueView, StepModel, Steps, compute_ttft_s, first_token_after_start_s
from router.loads import LoadTable

ENGINE_LINK = LinkMessages.of(engine_pb2)
# Recent samples the drain rate, the head-of-queue TTFT and the prediction's margin are taken over.
SAMPLES = 32
# The share of recent first tokens the margin covers: it is added to predictions held to a p99.
MARGIN_QUANTILE = 0.9
# The admission rate per tier is an exponentially decaying count: each request adds 1/tau per second.
# 1 s: a paid surge must count within a second, or the free requests admitted meanwhile starve.
ADMITTED_RATE_TAU_S = 1.0


@dataclass
class _Inflight:
    rank: int  # its tier's rank (chatmesh.tiers): engines serve higher ranks first
    dispatched_at: float
    at_head: bool  # nothing was queued there when it was sent: its TTFT is the engine's head-of-queue one
    prefill: int  # its prompt tokens to compute there (beyond the cached prefix predicted)
    predicted_ttft_s: float  # its time to a first token as the step model predicted it (0: no model)
    blocks: int = 0  # context blocks so far
    started: bool = False  # a token came back (until then it counts as waiting)


@dataclass(eq=False)
class EngineState:
    engine_id: str
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineServiceStub
    info: engine_pb2.GetModelInfoResponse | None = None  # kept across disconnects: which pool it is in
    load: engine_pb2.EngineLoad | None = None
    connected: bool = False  # its KvEvents and WatchLoad streams are up
    inflight: dict[str, _Inflight] = field(default_factory=dict)  # this router's requests, by request id
    inflight_blocks: int = 0
    inflight_waiting: int = 0  # of those, not started yet
    waiting_by_rank: list[int] = field(default_factory=lambda: [0] * len(TIERS))  # the same, per tier rank
    prefill_by_rank: list[int] = field(default_factory=lambda: [0] * len(TIERS))  # their prefill tokens
    foreign_prefill: int = 0  # prompt tokens pending at the last report beyond this router's requests
    foreign_blocks: int = 0  # blocks in use at the last report beyond this router's requests
    foreign_waiting: int = 0  # queued at the last report beyond this router's requests
    started_since_report: int = 0  # this router's requests that took a running slot since the last report
    sessions: int = 0  # sessions whose latest request this router placed here lately (router/sessions.py)
    finish_times: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    head_ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    head_ttft_s: float = 0.0  # their median: its time to a first token with nothing queued (0: unknown)
    # How much later than the step model predicted this router's recent requests got their first token.
    ttft_misses: deque[float] = field(default_factory=lambda: deque(maxlen=SAMPLES))
    ttft_margin_s: float = 0.0  # their MARGIN_QUANTILE, at least 0
    # Per tier rank: the decaying rate of requests sent here, as of the last one sent (admitted_at).
    admitted_rates: list[float] = field(default_factory=lambda: [0.0] * len(TIERS))
    admitted_at: list[float] = field(default_factory=lambda: [0.0] * len(TIERS))
    clock: Callable[[], float] = time.monotonic
    removed: bool = False  # gone from DNS; kept only while its streams finish
    table: LoadTable[EngineState] | None = (
        None  # where placement reads it (its row is rewritten on every change)
    )
    slot: int = -1

    def attach(self, table: LoadTable[EngineState], slot: int) -> None:
        self.table, self.slot = table, slot
        table.attach(self, slot)
        self._publish()

    def detach(self) -> None:
        """Leaves the table (the engine is gone; its row may go to another engine)."""
        if self.table is not None:
            self.table.detach(self.slot)
            self.table = None

    def _publish(self) -> None:
        if self.table is not None:
            self.table.write(self.slot, self)

    @cached_property
    def link(self) -> Link:
        """This router's one stream to the engine, which every request placed here shares."""
        return Link(self.stub.GenerateMany, ENGINE_LINK, f"engine {self.engine_id}")

    @property
    def healthy(self) -> bool:
        return self.connected and self.load is not None and self.load.serving and not self.removed

    @property
    def block_size(self) -> int:
        assert self.info is not None
        return self.info.block_size

    def disconnect(self) -> None:
        self.connected = False
        self.load = None
        self._publish()

    def report(self, load: engine_pb2.EngineLoad) -> None:
        self.load = load
        self.foreign_blocks = max(0, load.kv_blocks_used - self.inflight_blocks)
        self.foreign_waiting = max(0, load.waiting_requests - self.inflight_waiting)
        self.foreign_prefill = max(0, load.prefill_tokens - sum(self.prefill_by_rank))
        self.started_since_report = 0
        self._publish()

    # -- this router's requests ----------------------------------------------------------------------

    def dispatched(self, request_id: str, context_tokens: int, rank: int = 0, cached_tokens: int = 0) -> None:
        """Sent here; ``rank``: its tier's (``chatmesh.tiers.Tier.rank``); ``cached_tokens``: of its
        context, the prefix predicted cached here."""
        at_head = self.inflight_waiting + self.foreign_waiting == 0
        now = self.clock()
        self.admitted_rates[rank] = self._admitted_rate(rank, now) + 1 / ADMITTED_RATE_TAU_S
        self.admitted_at[rank] = now
        prefill = max(1, context_tokens - cached_tokens)
        model = self.step_model()
        predicted = 0.0
        if model is not None:
            steps = Steps.of([model], rank)
            predicted = float(compute_ttft_s(steps, np.array([prefill]), steps.prefill_ahead)[0])
        self.inflight[request_id] = _Inflight(rank, now, at_head, prefill, predicted)
        self.inflight_waiting += 1
        self.waiting_by_rank[rank] += 1
        self.prefill_by_rank[rank] += prefill
        self._resize(request_id, context_tokens)
        self._publish()

    def progressed(self, request_id: str, context_tokens: int) -> None:
        """A token came back; the request's context on this engine is now ``context_tokens`` long."""
        request = self.inflight.get(request_id)
        started = False
        if request is not None and not request.started:
            request.started = started = True
            self.started_since_report += 1
            self.inflight_waiting -= 1
            self.waiting_by_rank[request.rank] -= 1
            self.prefill_by_rank[request.rank] -= request.prefill
            ttft = self.clock() - request.dispatched_at
            if request.at_head:
                self.head_ttfts.append(ttft)
                self.head_ttft_s = statistics.median(self.head_ttfts)
            if request.predicted_ttft_s:
                self.ttft_misses.append(ttft - request.predicted_ttft_s)
                at = min(len(self.ttft_misses) - 1, round(MARGIN_QUANTILE * (len(self.ttft_misses) - 1)))
                self.ttft_margin_s = max(0.0, sorted(self.ttft_misses)[at])
        if self._resize(request_id, context_tokens) or started:  # most tokens change neither
            self._publish()

    def ended(self, request_id: str, completed: bool) -> None:
        request = self.inflight.pop(request_id, None)
        if request is not None:
            self.inflight_blocks -= request.blocks
            if not request.started:
                self.inflight_waiting -= 1
                self.waiting_by_rank[request.rank] -= 1
                self.prefill_by_rank[request.rank] -= request.prefill
        if completed:
            self.finish_times.append(self.clock())
        self._publish()

    def _resize(self, request_id: str, context_tokens: int) -> bool:
        """Sets the request's context; says whether its block count changed."""
        request = self.inflight.get(request_id)
        if request is None:
            return False
        blocks = math.ceil(context_tokens / self.block_size)
        self.inflight_blocks += blocks - request.blocks
        changed, request.blocks = blocks != request.blocks, blocks
        return changed

    def hold_sessions(self, delta: int) -> None:
        self.sessions += delta
        if self.table is not None:  # only this column changes: a whole row costs a queue view
            self.table.sessions[self.slot] = self.sessions

    # -- what placement and admission read -----------------------------------------------------------

    def decode_blocks(self) -> float:
        return float(self.inflight_blocks + self.foreign_blocks)

    def drain_rate(self) -> float:
        """Requests this router saw finish here per second, lately (0: not enough to tell)."""
        times = self.finish_times
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / (times[-1] - times[0])

    def _admitted_rate(self, rank: int, now: float) -> float:
        """Requests of ``rank`` this router sent here per second, lately."""
        return self.admitted_rates[rank] * math.exp(-(now - self.admitted_at[rank]) / ADMITTED_RATE_TAU_S)

    def _free_slots(self) -> int | None:
        """Running slots the engine's last report left for this router's requests not started yet (less
        what others' requests waiting there and this router's started since take). None when it blocks
        requests or does not say how many it runs: then whatever waits there is queued. An engine that
        blocks none starts what waits at its next step: a burst that arrived between two steps waits
        there, but is not a queue."""
        load = self.load
        if load is None or not load.max_running_requests or load.blocked_requests:
            return None
        taken = load.running_requests + self.foreign_waiting + self.started_since_report
        return max(0, load.max_running_requests - taken)

    def _queued_by_rank(self, free: int) -> list[int]:
        """Per tier rank, this router's requests not started yet that find no free slot: the engine
        gives the slots to higher tiers first."""
        queued = list(self.waiting_by_rank)
        for rank in reversed(range(len(queued))):
            starting = min(free, queued[rank])
            queued[rank] -= starting
            free -= starting
        return queued

    def queue_view(self) -> QueueView:
        max_waiting = self.load.max_waiting_requests if self.load is not None else 0
        free = self._free_slots()
        waiting_by_rank = self._queued_by_rank(free or 0)
        foreign_queued = self.foreign_waiting if free is None else 0
        # A new request of rank r waits behind this router's queued requests of rank >= r and behind
        # every foreign one (their tiers are unknown); later requests of higher ranks pass it, but only
        # while the engine itself reports a queue: with a free running slot it starts at once. (Its
        # finish rate lags what it is sent by a whole answer, so comparing the two when it is not
        # saturated would refuse lower tiers for nothing: the simulation at 1x lost a fifth of its hits.)
        queued = self.load is not None and self.load.blocked_requests > 0
        now = self.clock()
        ahead = [foreign_queued] * len(TIERS)
        higher_rate = [0.0] * len(TIERS)
        behind, passing = 0, 0.0
        for rank in reversed(range(len(TIERS))):
            higher_rate[rank] = passing
            behind += waiting_by_rank[rank]
            ahead[rank] += behind
            passing += self._admitted_rate(rank, now) if queued else 0.0
        return QueueView(
            self.engine_id,
            sum(waiting_by_rank) + foreign_queued,
            max_waiting,
            self.drain_rate(),
            tuple(ahead),
            self.head_ttft_s,
            tuple(higher_rate),
            self.step_model(),
        )

    def start_to_first_token_s(self, prefill_tokens: int) -> float:
        """The engine's time from the step that starts a request's prefill of ``prefill_tokens`` tokens
        to its first token: from its step time where it reports one, else its head-of-queue TTFT."""
        model = self.step_model()
        if model is None:
            return self.head_ttft_s
        steps = Steps.of([model], 0)
        return float(first_token_after_start_s(steps, np.array([prefill_tokens]))[0]) + model.margin_s

    def step_model(self) -> StepModel | None:
        """What the engine's steps take and the prompt tokens pending there; None when it does not
        report its step time. A new request's prefill waits for this router's requests of its tier and
        higher ones with no first token yet (engines schedule higher priorities first) and for everyone
        else's (their tiers are unknown); by then every request running or ahead of it is decoding."""
        load = self.load
        if load is None or not load.max_batched_tokens or not (load.step_fixed_s or load.step_token_s):
            return None
        ahead, pending = [0] * len(TIERS), self.foreign_prefill
        for rank in reversed(range(len(TIERS))):
            pending += self.prefill_by_rank[rank]
            ahead[rank] = pending
        decoding = load.running_requests + self.started_since_report + self.inflight_waiting
        if load.max_running_requests:
            decoding = min(decoding, load.max_running_requests)
        return StepModel(
            load.max_batched_tokens,
            load.step_fixed_s,
            load.step_token_s,
            decoding,
            pending,
            tuple(ahead),
            self.ttft_margin_s,
        )
