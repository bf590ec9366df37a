"""How this replica's runs end when it shuts down: a grace to finish, then the rest handed over."""

from __future__ import annotations

import asyncio
import logging

from orchestrator.config import RunConfig
from orchestrator.runs.held_runs import HeldRuns

log = logging.getLogger(__name__)


class Drain:
    def __init__(self, held: HeldRuns, config: RunConfig) -> None:
        self.held = held
        self.config = config

    async def shutdown(self, grace_s: float) -> int:
        """Lets runs finish for ``grace_s``, then hands the rest over: their output so far is stored
        and another replica adopts them (once this one says it is gone: ``Membership.leave``), so clients
        resuming elsewhere get the whole answer. A Complete, which nobody could resume, is interrupted.

        Runs that go live while the replica drains (sends already past the draining check, adoptions
        under way) are runs like the others: they get what is left of the grace, and one that goes live
        after it is handed over at once (``HeldRuns.relay``). Returns how many runs this replica handed
        over (in every call: the server calls it again once it stopped serving)."""
        held = self.held
        held.draining = True
        loop = asyncio.get_running_loop()
        hand_over_at = loop.time() + grace_s
        if held.tasks and grace_s > 0:
            log.info("waiting up to %.0fs for %d runs to finish", grace_s, len(held.tasks))
        await self._until_ended(hand_over_at)
        if left := held.hand_over_all():
            log.warning("handing over %d runs still generating", left)
        # Runs handed over store their output; runs on their way to going live (placement,
        # persistence) go on, and are handed over as they go live. Whatever is still on its way after
        # that ends with the replica: a run not yet stored as a refusal its caller may retry elsewhere;
        # one whose row may have landed is found in this replica's index (``Membership.leave``).
        await self._until_ended(loop.time() + self.config.cancel_timeout_s + self.config.store_deadline_s)
        for task in list(held.tasks):
            task.cancel()
        await asyncio.gather(*held.tasks, return_exceptions=True)
        return held.handed_over

    async def _until_ended(self, deadline: float) -> None:
        """Waits until every run task has ended (those started meanwhile too), or ``deadline``."""
        loop = asyncio.get_running_loop()
        while self.held.tasks and (left := deadline - loop.time()) > 0:
            await asyncio.wait(list(self.held.tasks), timeout=left)
