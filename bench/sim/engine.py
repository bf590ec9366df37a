"""A simulated engine: continuous batching, a paged KV cache with prefix reuse and LRU eviction, and the
same KV events (stored / removed chained block hashes) a real engine publishes.

Scheduling follows our engine's (engine/scheduler.py) in outline: each step decodes one token for every
running request and spends the rest of the token budget (``max_batched_tokens``) on prefill, oldest
first; a request that finished its prefill in a step has its first token at the end of that step.
Admission to running needs a running slot and KV blocks; paid requests are admitted before free ones.

The KV cache is kept per prefix chain rather than per block (for speed), with the behaviour of
engine/block_pool.py: a request pins its chain's cached blocks and allocates the rest of its prompt and
answer up front (a simplification: the real engine allocates as it goes and can preempt); when it
finishes, its full blocks stay cached (the partial last block is freed) and its chain becomes the most
recently used; allocation evicts the least recently used chains, from their tail (the real pool frees a
sequence's blocks tail first, so a chain's prefix outlives its tail). System prompts, shared by every
chat, stay cached once stored (a few hundred blocks, always hot).

Stored events come when the blocks are computed (prompt blocks at the end of prefill, answer blocks at
the end of the request), removed events when blocks are evicted; ``events`` receives
``(engine_id, stored: bool, hashes)``.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from bench.sim.costs import EngineCosts
from bench.sim.workload import Chat
from chatmesh.engine.v1 import engine_pb2
from router.admission import is_premium

EventSink = Callable[[str, bool, list[int]], None]


@dataclass(eq=False)
class Request:
    request_id: str
    chat: Chat
    tier: int
    arrival: float
    prompt_tokens: int
    prompt_blocks: int  # full blocks of the prompt (chat.hashes[:prompt_blocks])
    answer_tokens: int
    replica: int  # the router replica that placed it
    engine_id: str = ""
    cached_tokens: int = 0  # served from the engine's prefix cache
    predicted_cached_tokens: int = 0  # what the router's index said
    first_token: float = -1.0
    finished: float = -1.0
    attempts: int = 0
    prefill_left: int = 0
    own_blocks: int = 0  # blocks of the chain beyond the system prompt this request holds
    cached_own: int = 0
    hashes: list[int] = field(default_factory=list, repr=False)


@dataclass
class _Chain:
    hashes: list[int]  # the chat's hash list when it was cached (own blocks start at system_blocks)
    blocks: int  # own blocks cached


class SimEngine:
    def __init__(
        self,
        engine_id: str,
        costs: EngineCosts,
        system_blocks: int,
        events: EventSink,
        schedule: Callable[[float, Callable[[float], None]], None],
        on_first_token: Callable[[Request, float], None],
        on_finished: Callable[[Request, float], None],
    ) -> None:
        self.engine_id = engine_id
        self.costs = costs
        self.system_blocks = system_blocks
        self.events = events
        self.schedule = schedule
        self.on_first_token = on_first_token
        self.on_finished = on_finished
        self.alive = True
        self.free_blocks = costs.kv_blocks
        self.cache: OrderedDict[tuple[int, int], _Chain] = OrderedDict()  # idle chains, LRU first
        self.cached_blocks = 0  # own blocks in ``cache`` (evictable)
        self.systems: set[int] = set()
        self.waiting: dict[bool, deque[Request]] = {True: deque(), False: deque()}  # paid?, FIFO
        self.prefilling: deque[Request] = deque()
        self.decoding: list[tuple[int, int, Request]] = []  # (finishing step, admission order, request)
        self._order = itertools.count()
        self.used_blocks = 0  # held by admitted requests
        self.step_no = 0
        self.context_tokens = 0  # over decoding requests
        self.busy = False
        self.hit_tokens = 0
        self.queried_tokens = 0

    # -- what the router sees -------------------------------------------------------------------------

    def load(self) -> engine_pb2.EngineLoad:
        return engine_pb2.EngineLoad(
            waiting_requests=self.waiting_count(),
            blocked_requests=self.waiting_count(),
            running_requests=len(self.prefilling) + len(self.decoding),
            max_waiting_requests=self.costs.max_waiting_requests,
            max_running_requests=self.costs.max_running_requests,
            kv_blocks_total=self.costs.kv_blocks,
            kv_blocks_used=self.used_blocks,
            prefix_hit_tokens=self.hit_tokens,
            prefix_queried_tokens=self.queried_tokens,
            serving=self.alive,
        )

    def waiting_count(self) -> int:
        return len(self.waiting[True]) + len(self.waiting[False])

    def running_count(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    # -- requests -------------------------------------------------------------------------------------

    def submit(self, request: Request, now: float) -> None:
        self.waiting[is_premium(request.tier)].append(request)
        if not self.busy:
            self._step(now)

    def _admit(self) -> None:
        running = self.running_count()
        for paid in (True, False):
            queue = self.waiting[paid]
            while queue and running < self.costs.max_running_requests:
                if not self._allocate(queue[0]):
                    return  # FIFO within a tier: the head waits for blocks
                self.prefilling.append(queue.popleft())
                running += 1

    def _allocate(self, request: Request) -> bool:
        """Pins the request's cached prefix and allocates the rest of its prompt and answer."""
        bs = self.costs.block_size
        chat = request.chat
        system_cached = chat.system in self.systems
        chain = self.cache.get(chat.key) if system_cached else None
        cached_own = min(chain.blocks, request.prompt_blocks - self.system_blocks) if chain else 0
        total = math.ceil((request.prompt_tokens + request.answer_tokens) / bs)
        own = total - self.system_blocks
        need = own - cached_own + (0 if system_cached else self.system_blocks)
        evictable = self.cached_blocks - (chain.blocks if chain else 0)
        if need > self.free_blocks + evictable:
            return False
        if chain is not None:  # pinned: out of the LRU while running
            del self.cache[chat.key]
            self.cached_blocks -= chain.blocks
            self.free_blocks += chain.blocks - cached_own  # a longer stale tail is dropped
            if chain.blocks > cached_own:
                self.events(
                    self.engine_id,
                    False,
                    chain.hashes[self.system_blocks + cached_own :][: chain.blocks - cached_own],
                )
        self._evict(need - self.free_blocks)
        self.free_blocks -= need
        if not system_cached:
            self.systems.add(chat.system)
        self.used_blocks += own
        request.own_blocks = own
        request.cached_own = cached_own
        cached_blocks = (self.system_blocks + cached_own) if system_cached else 0
        request.cached_tokens = min(cached_blocks, (request.prompt_tokens - 1) // bs) * bs
        request.prefill_left = request.prompt_tokens - request.cached_tokens
        request.hashes = chat.hashes
        self.hit_tokens += request.cached_tokens
        self.queried_tokens += request.prompt_tokens
        return True

    def adopt(self, chat: Chat) -> None:
        """Caches ``chat``'s history as if its earlier turns had run here (a fleet already warm)."""
        sb = self.system_blocks
        own = len(chat.hashes) - sb
        new_system = chat.system not in self.systems
        need = own + (sb if new_system else 0)
        if need > self.free_blocks + self.cached_blocks:
            return
        self._evict(need - self.free_blocks)
        self.free_blocks -= need
        self.systems.add(chat.system)
        self.cache[chat.key] = _Chain(chat.hashes, own)
        self.cached_blocks += own
        self.events(self.engine_id, True, chat.hashes if new_system else chat.hashes[sb:])

    def _evict(self, blocks: int) -> None:
        sb = self.system_blocks
        while blocks > 0:
            key, chain = next(iter(self.cache.items()))
            take = min(chain.blocks, blocks)
            self.events(self.engine_id, False, chain.hashes[sb + chain.blocks - take : sb + chain.blocks])
            chain.blocks -= take
            self.cached_blocks -= take
            self.free_blocks += take
            blocks -= take
            if chain.blocks == 0:
                del self.cache[key]

    # -- steps ----------------------------------------------------------------------------------------

    def _step(self, now: float) -> None:
        self._admit()
        decoding = len(self.decoding)
        budget = self.costs.max_batched_tokens - decoding
        prefill = 0
        for request in self.prefilling:
            if budget <= 0:
                break
            chunk = min(request.prefill_left, budget)
            prefill += chunk
            budget -= chunk
        if not decoding and not prefill:
            self.busy = False
            return
        self.busy = True
        duration = self.costs.step_s(decoding, prefill, self.context_tokens)
        self.schedule(now + duration, self._step_end)

    def _step_end(self, now: float) -> None:
        if not self.alive:
            return
        self.step_no += 1
        self.context_tokens += len(self.decoding)
        budget = self.costs.max_batched_tokens - len(self.decoding)  # as planned when the step began
        while self.decoding and self.decoding[0][0] <= self.step_no:
            _, _, request = heapq.heappop(self.decoding)
            self.context_tokens -= request.prompt_tokens + request.answer_tokens
            self._finish(request, now)
        while self.prefilling and budget > 0:
            request = self.prefilling[0]
            chunk = min(request.prefill_left, budget)
            request.prefill_left -= chunk
            budget -= chunk
            if request.prefill_left:
                break
            self.prefilling.popleft()
            self._first_token(request, now)
        self._step(now)

    def _first_token(self, request: Request, now: float) -> None:
        sb = self.system_blocks
        stored = request.hashes[sb + request.cached_own : request.prompt_blocks]
        if request.cached_tokens == 0:
            stored = request.hashes[:sb] + stored  # first use of this system prompt here
        if stored:
            self.events(self.engine_id, True, stored)
        self.on_first_token(request, now)
        heapq.heappush(self.decoding, (self.step_no + request.answer_tokens - 1, next(self._order), request))
        self.context_tokens += request.prompt_tokens + 1

    def _finish(self, request: Request, now: float) -> None:
        """The answer is done: its full blocks stay cached as the chat's chain, the most recently used."""
        self.on_finished(request, now)  # the chat appends the answer (and its block hashes)
        sb = self.system_blocks
        chat = request.chat
        full_own = (request.prompt_tokens + request.answer_tokens) // self.costs.block_size - sb
        self.used_blocks -= request.own_blocks
        self.free_blocks += request.own_blocks - full_own
        self.events(self.engine_id, True, chat.hashes[request.prompt_blocks : sb + full_own])
        self.cache[chat.key] = _Chain(chat.hashes, full_own)
        self.cached_blocks += full_own

    # -- failure --------------------------------------------------------------------------------------

    def fail(self) -> list[Request]:
        """The engine dies: every request on it is returned (to fail over); nothing more happens here."""
        self.alive = False
        lost = [
            *self.waiting[True],
            *self.waiting[False],
            *self.prefilling,
            *(r for _, _, r in self.decoding),
        ]
        for queue in self.waiting.values():
            queue.clear()
        self.prefilling.clear()
        self.decoding.clear()
        return lost
