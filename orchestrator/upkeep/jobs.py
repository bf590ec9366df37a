"""Background generations (chat titles, rolling summaries): bounded, low priority, never in a send's way.

Jobs run at most ``concurrency`` at a time, at most ``queue`` waiting; a job beyond that is dropped
and counted (a missing title or a stale summary is harmless; the next trigger tries again). A job for
a key already queued or running (one summary per chat) is not queued twice. Generations go through the
router as TIER_FREE, the lowest priority, so they are shed first under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Awaitable, Callable

from chatmesh.limits import Generation
from orchestrator.metrics import METRICS
from orchestrator.router_client import RouterClient, start_frame

log = logging.getLogger(__name__)


class BackgroundJobs:
    def __init__(self, concurrency: int, queue: int, timeout_s: float) -> None:
        self._slots = asyncio.Semaphore(max(1, concurrency))
        self._limit = max(1, concurrency) + max(0, queue)
        self._timeout_s = timeout_s
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def submit(self, kind: str, key: str, job: Callable[[], Awaitable[None]]) -> bool:
        """Schedules ``job`` unless one for ``key`` is pending or the queue is full."""
        key = f"{kind}:{key}"
        if key in self._tasks:
            return False
        if len(self._tasks) >= self._limit:
            METRICS.background_jobs.labels(kind, "dropped").inc()
            return False
        self._tasks[key] = asyncio.create_task(self._run(kind, key, job), name=key)
        return True

    async def _run(self, kind: str, key: str, job: Callable[[], Awaitable[None]]) -> None:
        try:
            async with self._slots:
                async with asyncio.timeout(self._timeout_s):
                    await job()
            METRICS.background_jobs.labels(kind, "done").inc()
        except asyncio.CancelledError:
            METRICS.background_jobs.labels(kind, "cancelled").inc()
            raise
        except Exception as exc:
            METRICS.background_jobs.labels(kind, "failed").inc()
            log.warning("background %s failed: %s", key, exc)
        finally:
            self._tasks.pop(key, None)

    async def idle(self) -> None:
        """Waits until no job is pending (tests, shutdown)."""
        while self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)


async def generate_text(
    router: RouterClient,
    prompt: list[int],
    generation: Generation,
    fingerprint: str,
    deadline_s: float,
) -> str:
    """A whole answer from the router at the lowest priority (for titles and summaries). Under no
    session: the job is not a turn of its chat (its prompt does not extend the chat's context), so it
    must not move where the router believes the chat is held, nor replace the chat's session hint."""
    start = start_frame(f"bg-{uuid.uuid4().hex}", prompt, generation, "free", "", fingerprint)
    stream = await router.place(start, deadline_s, deadline_s)
    parts: list[str] = []
    try:
        async for frame in stream.frames(lambda tokens: parts.append(tokens.text)):
            if frame.WhichOneof("kind") == "finished":
                parts.append(frame.finished.text)
    except BaseException:
        stream.abort()
        raise
    finally:
        stream.close()
    return "".join(parts)
