"""Where each session (chat) last ran: the placement hint for when the index has not heard yet.

The index learns a chat's blocks from the engine's KV events, which arrive after the engine stored
them (the engine publishes once a step; the stream, and under load the router's own event loop, add
more). A chat's next turn that comes within that lag finds the index without the last answer's blocks
and may be placed on an engine that holds less of it. So the router remembers, per session id, the
engine that last finished a run of it and how far that engine's computed context reaches, named by the
chained hash of its last full block (a hash names its whole prefix, ``chatmesh.block_hash``): the next
prompt extends that context exactly when its own block hash at that position is the same. That is all
the hint claims; ``policy.with_hint`` decides when it counts.

The same module counts the sessions each engine holds (``SessionsHeld``), which a new session's
placement weighs (router/policy.py).

Memory is bounded: the least recently finished sessions are forgotten first (a forgotten session is
placed by the index alone, as without hints). Each router replica remembers the sessions it finished
itself: a turn finds its hint when the replica that placed the chat's previous turn places it again,
which the orchestrator sees to (it sends a chat's requests to one router while that router is up:
orchestrator/router_client.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SessionHint:
    """The engine a session last ran on and the leading blocks of its context computed there, as
    (block count, hash of the last of them), deepest first: the whole context (prompt and answer),
    then the prompt alone (for a next prompt that re-encodes the answer differently)."""

    engine_id: str
    anchors: tuple[tuple[int, int], ...]

    def vouched_blocks(self, prompt_hashes: Sequence[int]) -> int:
        """How many leading blocks of ``prompt_hashes`` (hashed as the hinted engine hashes) that
        engine computed for this session: the deepest anchor the prompt extends, or 0."""
        for blocks, last_hash in self.anchors:
            if len(prompt_hashes) >= blocks and prompt_hashes[blocks - 1] == last_hash:
                return blocks
        return 0


class SessionHints:
    """A bounded LRU of session id → ``SessionHint`` (``capacity`` 0 remembers nothing)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hints: OrderedDict[str, SessionHint] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hints)

    def get(self, session_id: str) -> SessionHint | None:
        return self._hints.get(session_id) if session_id else None

    def remember(
        self, session_id: str, engine_id: str, context_hashes: Sequence[int], prompt_blocks: int
    ) -> None:
        """A run of ``session_id`` finished on ``engine_id``, which computed the blocks
        ``context_hashes`` (its prompt's ``prompt_blocks``, then its answer's)."""
        if not session_id or not self.capacity or not context_hashes:
            return
        anchors = [(len(context_hashes), context_hashes[-1])]
        if 0 < prompt_blocks < len(context_hashes):
            anchors.append((prompt_blocks, context_hashes[prompt_blocks - 1]))
        self._hints[session_id] = SessionHint(engine_id, tuple(anchors))
        self._hints.move_to_end(session_id)
        if len(self._hints) > self.capacity:
            self._hints.popitem(last=False)


# Sessions counted at most (about 150 bytes each); past it the least recently placed are dropped, so
# every engine's count shrinks in proportion and the comparison between engines survives.
MAX_SESSIONS_HELD = 1_000_000


class Holder(Protocol):
    """An engine whose held-session count placement reads (``router.engines.EngineState``)."""

    def hold_sessions(self, delta: int) -> None: ...


class SessionsHeld:
    """How many sessions each engine holds: the sessions whose latest request was placed there less than
    ``idle_s`` ago, running or between turns. A chat between turns runs nothing anywhere, yet its next
    turn will go where its history is cached: the engine holds it all the same. Counted by the replica
    that placed the request (with several router replicas each counts its share)."""

    def __init__(self, idle_s: float, capacity: int = MAX_SESSIONS_HELD) -> None:
        self.idle_s = idle_s
        self.capacity = capacity
        self._where: OrderedDict[str, tuple[Holder, float]] = OrderedDict()  # oldest placement first

    def __len__(self) -> int:
        return len(self._where)

    def placed(self, session_id: str, engine: Holder, now: float) -> None:
        """A request of ``session_id`` went to ``engine`` at ``now``: the session is held there now."""
        if not session_id:
            return
        previous = self._where.pop(session_id, None)
        if previous is not None:
            previous[0].hold_sessions(-1)
        engine.hold_sessions(1)
        self._where[session_id] = (engine, now)
        if len(self._where) > self.capacity:
            self._drop_oldest()

    def expire(self, now: float) -> None:
        """Forgets the sessions placed more than ``idle_s`` before ``now`` (oldest first: amortized O(1))."""
        while self._where:
            _, (_, placed_at) = next(iter(self._where.items()))
            if now - placed_at <= self.idle_s:
                return
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (engine, _) = self._where.popitem(last=False)
        engine.hold_sessions(-1)
