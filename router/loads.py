"""What placement reads of every engine, as columns: one row per engine, at its index slot.

Placement weighs every engine of a pool for every request. Reading a thousand ``EngineState`` objects
in Python costs milliseconds a decision; reading these columns costs a few vector operations. Each
``EngineState`` writes its row whenever what placement reads of it changes (a load report, a dispatch,
a first token, an end, a disconnect), so the columns are never stale. Rows share the ``PrefixIndex``'s
slot numbers, so the index's answer for every slot lines up with them.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

import numpy as np

from chatmesh.engine.v1 import engine_pb2
from chatmesh.tiers import TIERS
from router.admission import NO_STEPS, QueueView
from router.policy import engine_key

_NO_POOL = -1


class EngineRow(Protocol):
    """What a row is written from: the router's state of one engine (``router.engines.EngineState``)."""

    engine_id: str
    info: engine_pb2.GetModelInfoResponse | None
    sessions: int

    @property
    def healthy(self) -> bool: ...
    def decode_blocks(self) -> float: ...
    def queue_view(self) -> QueueView: ...


State = TypeVar("State", bound=EngineRow)


class LoadTable(Generic[State]):
    """The columns, and the engine state each attached row belongs to (placement answers with it)."""

    def __init__(self, capacity: int = 64) -> None:
        self.states: list[State | None] = [None] * capacity
        self.engine_ids = np.full(capacity, "", dtype=object)
        self.healthy = np.zeros(capacity, dtype=bool)
        self.pool = np.full(capacity, _NO_POOL, dtype=np.int64)  # id of (model, tokenizer) served
        self.hashing = np.zeros(capacity, dtype=np.int64)  # id of (block size, hash seed)
        self.block_size = np.ones(capacity, dtype=np.int64)
        self.decode_blocks = np.zeros(capacity, dtype=np.float64)
        self.sessions = np.zeros(capacity, dtype=np.int64)
        self.waiting = np.zeros(capacity, dtype=np.int64)
        self.max_waiting = np.zeros(capacity, dtype=np.int64)
        self.ahead = np.zeros((capacity, len(TIERS)), dtype=np.int64)  # queued ahead, per tier rank
        self.drain_rate = np.zeros(capacity, dtype=np.float64)
        self.head_ttft_s = np.zeros(capacity, dtype=np.float64)
        self.higher_rate = np.zeros((capacity, len(TIERS)), dtype=np.float64)  # per tier rank
        # The engine's step model (router.admission.StepModel); all zeros where it reports none.
        self.step_budget = np.zeros(capacity, dtype=np.int64)
        self.step_fixed_s = np.zeros(capacity, dtype=np.float64)
        self.step_token_s = np.zeros(capacity, dtype=np.float64)
        self.decoding = np.zeros(capacity, dtype=np.int64)
        self.prefill_pending = np.zeros(capacity, dtype=np.int64)
        self.prefill_ahead = np.zeros((capacity, len(TIERS)), dtype=np.int64)  # per tier rank
        self.ttft_margin_s = np.zeros(capacity, dtype=np.float64)
        self.rendezvous_key = np.zeros(capacity, dtype=np.uint64)
        self.order = np.zeros(0, dtype=np.int64)  # attached rows in engine-id order
        # Bumped whenever which rows are attached, healthy, in which pool, or their queue bound changes:
        # placement caches each pool's healthy rows and each tier's queue limits until then (load
        # reports, many a second, rarely change any of it).
        self.version = 0
        self._pools: dict[tuple[str, str], int] = {}
        self._hashings: dict[tuple[int, int], int] = {}
        self._hashing_keys: list[tuple[int, int]] = []

    @property
    def capacity(self) -> int:
        return len(self.states)

    def attach(self, state: State, slot: int) -> None:
        while slot >= self.capacity:
            self._grow()
        self.states[slot] = state
        self.engine_ids[slot] = state.engine_id
        self.rendezvous_key[slot] = engine_key(state.engine_id)
        self._reorder()

    def detach(self, slot: int) -> None:
        self.states[slot] = None
        self.engine_ids[slot] = ""
        self.healthy[slot] = False
        self.pool[slot] = _NO_POOL
        self._reorder()

    @property
    def one_hashing(self) -> bool:
        """Every engine ever attached hashes blocks alike (one block size and seed): the usual fleet."""
        return len(self._hashing_keys) == 1

    def hashing_of(self, hashing: int) -> tuple[int, int]:
        """The (block size, seed) behind a ``hashing`` id."""
        return self._hashing_keys[hashing]

    def pool_mask(self, model: str, tokenizer_fingerprint: str) -> np.ndarray:
        """Which rows serve ``model`` (with ``tokenizer_fingerprint``, unless it is empty)."""
        pools = self.pool_ids(model, tokenizer_fingerprint)
        return self.pool == pools[0] if len(pools) == 1 else np.isin(self.pool, pools)

    def pool_ids(self, model: str, tokenizer_fingerprint: str) -> list[int]:
        """The pool ids serving ``model`` (any tokenizer when ``tokenizer_fingerprint`` is empty)."""
        return [
            pool
            for (served, fingerprint), pool in self._pools.items()
            if served == model and (not tokenizer_fingerprint or fingerprint == tokenizer_fingerprint)
        ]

    def models(self) -> set[str]:
        """The models the attached engines serve."""
        present = set(np.unique(self.pool[self.order]).tolist())
        return {model for (model, _), pool in self._pools.items() if pool in present}

    def write(self, slot: int, state: State) -> None:
        """``state``'s row, from what it knows now."""
        info = state.info
        # An embedding engine is in no generation pool (router/embeds.py places its calls).
        if info is not None and info.kind != engine_pb2.MODEL_KIND_EMBEDDING:
            pool = self._pools.setdefault((info.model, info.tokenizer_fingerprint), len(self._pools))
            if pool != self.pool[slot]:
                self.pool[slot] = pool
                self.version += 1
            key = (info.block_size, info.block_hash_seed)
            if key not in self._hashings:
                self._hashings[key] = len(self._hashing_keys)
                self._hashing_keys.append(key)
            self.hashing[slot] = self._hashings[key]
            self.block_size[slot] = info.block_size
        if state.healthy != self.healthy[slot]:
            self.healthy[slot] = state.healthy
            self.version += 1
        self.decode_blocks[slot] = state.decode_blocks()
        self.sessions[slot] = state.sessions
        view = state.queue_view()
        self.waiting[slot] = view.waiting
        if view.max_waiting != self.max_waiting[slot]:
            self.max_waiting[slot] = view.max_waiting
            self.version += 1
        self.ahead[slot] = view.ahead
        self.drain_rate[slot] = view.drain_rate
        self.head_ttft_s[slot] = view.head_ttft_s
        self.higher_rate[slot] = view.higher_rate
        steps = view.steps or NO_STEPS
        self.step_budget[slot] = steps.budget
        self.step_fixed_s[slot] = steps.fixed_s
        self.step_token_s[slot] = steps.token_s
        self.decoding[slot] = steps.decoding
        self.prefill_pending[slot] = steps.prefill_pending
        self.prefill_ahead[slot] = steps.prefill_ahead
        self.ttft_margin_s[slot] = steps.margin_s

    def _reorder(self) -> None:
        rows = [slot for slot, state in enumerate(self.states) if state is not None]
        self.order = np.array(sorted(rows, key=lambda slot: self.engine_ids[slot]), dtype=np.int64)
        self.version += 1

    def _grow(self) -> None:
        size = self.capacity
        self.states += [None] * size
        for name, column in list(vars(self).items()):
            if isinstance(column, np.ndarray) and name != "order":
                setattr(self, name, np.concatenate([column, np.zeros_like(column)]))
        self.pool[size:] = _NO_POOL
        self.block_size[size:] = 1
        self.engine_ids[size:] = ""
