"""Where a run held by this replica stands, the moves between those states, and why a run stops early.

    STARTING ──► LIVE ──► ENDED          its end is stored (or left to ``late_ends.py``) and streamed
        │          └────► HANDED_OVER    another replica goes on with it; streams resume there
        ├───────────────► HANDED_OVER    an adopted run let go before it went live (not placed again)
        └───────────────► ENDED          a run ended before its relay started

STARTING: the run is in this replica's index with its first events (``started``; an adopted run's
checkpointed output too) and no relay yet: a new run for the instant before its relay starts, an
adopted run while the router places it again. A stop asked for then applies as it goes live. LIVE:
its relay generates it. ENDED and HANDED_OVER are final: no event follows either. An ended run is kept
for ``finished_ttl_s`` (streams attach to it in memory); a handed-over one is forgotten at once (its
streams resume from Cassandra, wherever their next call lands).
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    STARTING = "starting"
    LIVE = "live"
    ENDED = "ended"
    HANDED_OVER = "handed_over"

    @property
    def done_here(self) -> bool:
        """Whether the run generates no more here: it ended, or another replica goes on with it."""
        return self in _FINAL


_FINAL = frozenset({RunState.ENDED, RunState.HANDED_OVER})
_MOVES = {
    RunState.STARTING: frozenset({RunState.LIVE, RunState.ENDED, RunState.HANDED_OVER}),
    RunState.LIVE: _FINAL,
}


def check_move(run_id: str, state: RunState, to: RunState) -> RunState:
    """``to``, if a run in ``state`` may move there; a RuntimeError (a defect of this replica's) if not."""
    if to not in _MOVES.get(state, frozenset()):
        raise RuntimeError(f"run {run_id} cannot move from {state} to {to}")
    return to


class Stop(StrEnum):
    """Why a run stops before the engine ends it."""

    CANCELLED = "cancelled"  # CancelRun, here or on another replica
    CONTENT_FILTER = "content_filter"  # output moderation
    INTERRUPTED = "interrupted"  # this replica shuts down and nobody could go on with the run (Complete)
    HANDED_OVER = "handed_over"  # this replica shuts down; another one adopts the run
    SUPERSEDED = "superseded"  # another replica adopted the run (this one was taken for dead)
