"""Which tokens of which requests the next step computes: vLLM V1's one rule, with priorities.

Each step hands out a budget of ``max_batched_tokens``. A scheduled request's computed tokens catch up
with its known tokens as far as the budget allows: a prefill chunk, the rest of a prompt after a
prefix-cache hit and a single decode token are all that one rule; a decoding request with draft tokens
(``engine.speculation``) computes them after its newest token where budget and free blocks allow, never
at anyone's expense. Running requests go first (decodes
before prefill chunks, so a long new prompt never stalls streams already talking), then waiting ones
in priority order while budget, blocks and running slots last.

Priority with aging is a static key (``Request.sort_key``): the waiting queue is a heap on it. When
blocks run out, the running request with the worst key (lowest priority, newest) is preempted by
recompute: its blocks are freed (the full ones stay in the prefix cache, so recomputing is often
cheap) and it waits again with its old key. A waiting request with a better key than a running one
may displace it when blocks or running slots are short, so a high-priority request is never stuck
behind a batch of long low-priority generations; aging bounds how long anyone can be displaced.

A request may carry a queue limit (``EngineRequest.max_queue_s``, set by a router holding it to a
time-to-first-token objective): one still waiting, never scheduled, when its limit passes is taken out
by ``expire`` and refused, rather than served after its objective is lost. Under strict priorities that
is what bounds a low tier's wait while higher tiers take every slot; aging alone would hold it for
``priority_aging_s`` and then put it ahead of the tier above.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    scheduled: dict[Request, int] = field(default_factory=dict)  # tokens to compute, in batch order
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_batched_tokens: int,
        max_running_requests: int,
        watermark_blocks: int = 0,
    ) -> None:
        self.kv = kv
        self.max_batched_tokens = max_batched_tokens
        self.max_running_requests = max_running_requests
        # Blocks kept free when admitting new requests, so running ones can grow without preemptions.
        self.watermark_blocks = watermark_blocks
        self._waiting: list[tuple[tuple[float, int], Request]] = []  # heap; finished entries are stale
        # Heap of (queue deadline, serial, request) of requests never scheduled; started or finished ones
        # are stale.
        self._deadlines: list[tuple[float, int, Request]] = []
        self.num_waiting = 0
        self.waiting_prefill_tokens = 0  # the waiting requests' queued_prefill_tokens
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (req.sort_key, req))
        self.num_waiting += 1
        # Looked up once here (its block hashes are kept for its scheduling): what the router predicts
        # a new request's wait from must not count prompt tokens the cache holds.
        cached = len(self.kv.get_computed_blocks(req)) * self.kv.block_size
        req.queued_prefill_tokens = req.num_tokens - cached
        self.waiting_prefill_tokens += req.queued_prefill_tokens
        if req.queue_deadline is not None and not req.started:
            heapq.heappush(self._deadlines, (req.queue_deadline, req.serial, req))

    def expire(self, now: float) -> list[Request]:
        """The waiting requests, never scheduled, whose queue limit has passed by ``now``: the caller
        refuses them (``finish`` takes them out). Asked after ``schedule``, so a request expires only
        when a step had no room to start it."""
        expired = []
        while self._deadlines and self._deadlines[0][0] <= now:
            req = heapq.heappop(self._deadlines)[2]
            if req.status is RequestStatus.WAITING and not req.started:
                expired.append(req)
        return expired

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens still to compute before first tokens: running prefills' rest (a decoding
        request has one token to compute, its last sampled one) and the waiting requests'."""
        running = sum(n for req in self.running if (n := req.num_uncomputed_tokens) > 1)
        return running + self.waiting_prefill_tokens

    def has_work(self) -> bool:
        return bool(self.num_waiting or self.running)

    def finish(self, req: Request) -> None:
        """Takes ``req`` out of the scheduler (done, cancelled or failed) and frees its blocks at once."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self.num_waiting -= 1  # its heap entry is skipped when it surfaces
            self.waiting_prefill_tokens -= req.queued_prefill_tokens
        self.kv.free(req)
        req.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batched_tokens
        for running in sorted(self.running, key=lambda s: (s.num_uncomputed_tokens > 1, s.sort_key)):
            if budget == 0:
                break
            if running.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if running.draft_token_ids and (num_new := self._schedule_drafts(running, budget)):
                out.scheduled[running] = num_new
                budget -= num_new
                continue
            num_new = min(running.num_uncomputed_tokens, budget)
            while not self.kv.allocate_slots(running, num_new):
                victim = max(self.running, key=lambda s: s.sort_key)
                budget += self._preempt(victim, out)
                if victim is running:
                    break
            else:
                out.scheduled[running] = num_new
                budget -= num_new
        # Memory is short: admitting more now would only preempt again.
        if out.preempted:
            return out

        while budget > 0 and (req := self._peek_waiting()) is not None and req not in out.preempted:
            if len(self.running) >= self.max_running_requests:
                if (refund := self._displace_for(req, out)) is None:
                    break
                budget += refund
            computed = self.kv.get_computed_blocks(req)
            num_computed = len(computed) * self.kv.block_size
            num_new = min(req.num_tokens - num_computed, budget)
            reserve = self.watermark_blocks if self.running else 0
            if not self.kv.allocate_slots(req, num_new, computed, reserve):
                if (refund := self._displace_for(req, out)) is None:
                    break
                budget += refund
                continue
            heapq.heappop(self._waiting)
            self.num_waiting -= 1
            self.waiting_prefill_tokens -= req.queued_prefill_tokens
            self.prefix_queried_tokens += req.num_tokens
            self.prefix_hit_tokens += num_computed
            if req.num_prefix_hit_tokens is None:
                req.num_prefix_hit_tokens = min(num_computed, req.num_context_tokens)
            req.num_computed_tokens = num_computed
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled[req] = num_new
            budget -= num_new
        return out

    def update(self, out: SchedulerOutput, rejected: Mapping[Request, int] | None = None) -> None:
        """After the step ran: the scheduled tokens now have KV; their full blocks join the prefix cache.

        ``rejected``: per request, the draft tokens at the end of its scheduled ones that the model did
        not accept. Their KV was written but does not count: it is never cached (so never hashed or
        published), and the next tokens computed at their positions overwrite it."""
        for req, num_new in out.scheduled.items():
            req.num_computed_tokens += num_new - (rejected.get(req, 0) if rejected else 0)
            req.draft_token_ids = []
            self.kv.cache_computed_blocks(req)

    def _schedule_drafts(self, req: Request, budget: int) -> int:
        """Room for a decoding request's newest token and as many of its drafts as the budget and the
        free blocks above the watermark allow: the tokens it computes, or 0 (no drafts: it is scheduled
        as usual). Speculation never preempts anyone, nor takes the blocks kept for new requests."""
        drafts = req.draft_token_ids
        del drafts[max(budget - 1, 0) :]
        if drafts and not self.kv.allocate_slots(req, 1 + len(drafts), reserve=self.watermark_blocks):
            drafts.clear()
        return 1 + len(drafts) if drafts else 0

    def _peek_waiting(self) -> Request | None:
        while self._waiting:
            req = self._waiting[0][1]
            if req.status is RequestStatus.WAITING:
                return req
            heapq.heappop(self._waiting)  # finished while waiting
        return None

    def _displace_for(self, req: Request, out: SchedulerOutput) -> int | None:
        """Preempts the worst running request if ``req`` outranks it and returns the budget that frees;
        None if nobody running ranks below ``req``."""
        if not self.running:
            return None
        victim = max(self.running, key=lambda s: s.sort_key)
        if victim.sort_key < req.sort_key:
            return None
        return self._preempt(victim, out)

    def _preempt(self, req: Request, out: SchedulerOutput) -> int:
        """Back to waiting with its blocks freed; returns the budget it had been given this step."""
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        self.add(req)
        self.num_preemptions += 1
        out.preempted.append(req)
        return out.scheduled.pop(req, 0)
