"""The event loop every chatmesh service runs on: uvloop (libuv's loop, in C) unless told otherwise.

Every token crosses four Python processes, each paying the event loop's own work per message (waking
tasks, timers, transport writes) besides gRPC's; uvloop does that work in C. gRPC's asyncio stack runs on
any asyncio loop. ``CHATMESH_EVENT_LOOP=asyncio`` runs the standard library's loop instead: to compare
(README, "uvloop"), or to use asyncio's debug mode.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
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


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop."""
    if chosen() == "uvloop":
        return uvloop.run(main)
    return asyncio.run(main)
