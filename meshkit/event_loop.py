"""The event loop every chatmesh service runs on: uvloop (libuv's loop, in C) unless told otherwise, the
garbage collector tuned for a server's heap, and the loop's lag measured.

Every token crosses four Python processes, each paying the event loop's own work per message (waking
tasks, timers, transport writes) besides gRPC's; uvloop does that work in C. gRPC's asyncio stack runs on
any asyncio loop. ``CHATMESH_EVENT_LOOP=asyncio`` runs the standard library's loop instead: to compare
(docs/benchmarks/front_door.md, "uvloop in every service"), or to use asyncio's debug mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import uvloop
from prometheus_client import REGISTRY, CollectorRegistry

from meshkit.metrics import ComponentMetrics

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
    """The collector tuned for a long-running server while the block runs (then as it was), each of its
    passes timed (``gc_pause_seconds``)."""
    threshold = gc.get_threshold()
    timer = _pause_timer(METRICS)
    gc.freeze()
    gc.set_threshold(YOUNG_GENERATION, *threshold[1:])
    gc.callbacks.append(timer)
    try:
        yield
    finally:
        gc.callbacks.remove(timer)
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _pause_timer(metrics: EventLoopMetrics) -> Callable[[str, dict[str, int]], None]:
    """A ``gc.callbacks`` entry that observes how long each collector pass takes, by generation."""
    by_generation = [metrics.gc_pause.labels(str(generation)) for generation in range(3)]
    started = 0.0

    def on_pass(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started)

    return on_pass


# How often the lag is sampled: a timer four times a second costs nothing, and gives a minute's window
# 240 samples for its percentiles.
LAG_SAMPLE_S = 0.25
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# A young pass takes tens of microseconds, a full one over a busy heap up to seconds.
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class EventLoopMetrics(ComponentMetrics):
    component = "event_loop"

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        super().__init__(registry)
        self.lag = self.histogram(
            "lag_seconds",
            f"How late the event loop ran a timer due every {LAG_SAMPLE_S:g} s: how long anything ready "
            "(a token to relay, a new call to take) waits for the process's one Python thread",
            buckets=LAG_BUCKETS,
        )
        self.gc_pause = self.histogram(
            "gc_pause_seconds",
            "How long each pass of the garbage collector held the process's Python thread, by generation "
            "(2: a full pass over every tracked object): the share of the loop's lag that is the collector",
            ["generation"],
            buckets=GC_PAUSE_BUCKETS,
        )


METRICS = EventLoopMetrics()

# How much of the recent lag each new sample replaces: at four samples a second, the recent lag is about
# the last two seconds' (a lone late timer moves it a quarter of the way).
RECENT_LAG_WEIGHT = 0.25


class RecentLag:
    """The loop's lag of late: the mean of ``watch_lag``'s samples, weighted toward the newest. What a
    process reads of its own saturation to adapt to it (``meshkit.pacing``)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def observe(self, lag_s: float) -> None:
        self.seconds += RECENT_LAG_WEIGHT * (lag_s - self.seconds)


RECENT_LAG = RecentLag()


def _observe_lag(lag_s: float) -> None:
    METRICS.lag.observe(lag_s)
    RECENT_LAG.observe(lag_s)


async def watch_lag(observe: Callable[[float], None] = _observe_lag, every_s: float = LAG_SAMPLE_S) -> None:
    """Observes the running loop's lag every ``every_s`` until cancelled.

    A Python service's saturation signal, in the unit its callers feel: a CPU share is averaged over
    the process's threads and over a scrape interval, while this is how long anything ready waits for
    the one thread that runs it. Once the loop is behind, new calls wait too: a replica whose relaying
    leaves too little of its thread for the calls arriving takes them more slowly than they come, and
    they wait in gRPC's queue until ``--max-pending-s`` sheds them (docs/benchmarks/front_door.md, "Saturation, read off the
    event loops")."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        # Never negative: uvloop's timers count whole milliseconds, and may fire that much early.
        observe(max(0.0, loop.time() - due))


async def _watching_lag(main: Coroutine[Any, Any, T]) -> T:
    watcher = asyncio.create_task(watch_lag(), name="event-loop-lag")
    try:
        return await main
    finally:
        watcher.cancel()


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on the chosen loop, with ``server_gc``, its lag watched (``watch_lag``)."""
    with server_gc():
        if chosen() == "uvloop":
            return uvloop.run(_watching_lag(main))
        return asyncio.run(_watching_lag(main))
