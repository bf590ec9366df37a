"""The event loop every chatmesh service runs on: uvloop (libuv's loop, in C) unless told otherwise, and
the garbage collector tuned for a server's heap.

Every token crosses four Python processes, each paying the event loop's own work per message (waking
tasks, timers, transport writes) besides gRPC's; uvloop does that work in C. gRPC's asyncio stack runs on
any asyncio loop. ``CHATMESH_EVENT_LOOP=asyncio`` runs the standard library's loop instead: to compare
(README, "uvloop"), or to use asyncio's debug mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import uvloop

ENV = "CHATMESH_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")

T = TypeVar("T")


def chosen() -> str:
    """``uvloop`` or ``asyncio``, from ``CHATMESH_EVENT_LOOP`` (default ``uvloop``)."""
    choice = os.environ.get(ENV, "uvloop") or "uvloop"
    if choice not in CHOICES:
        raise SystemExit(f"{ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    return choice


# CPython's collector runs a young-generation pass every 700 allocations, and full passes over every
# tracked object as survivors pile up. A server's heap is mostly long-lived (modules, channels, and each
# open stream's tasks and buffers), and each relayed token allocates: at 3,000 open streams the
# orchestrator spent ~10 % of its CPU in the collector (py-spy). Freezing what the imports built keeps it
# out of every pass, and a young generation this large makes passes rarer. Reference counting still
# frees all acyclic garbage at once; only cycles wait longer.
YOUNG_GENERATION = 20_000


@contextlib.contextmanager
def server_gc() -> Iterator[None]:
    """The collector tuned for a long-running server while the block runs (then as it was)."""
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(YOUNG_GENERATION, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop, with ``server_gc``."""
    with server_gc():
        if chosen() == "uvloop":
            return uvloop.run(main)
        return asyncio.run(main)
