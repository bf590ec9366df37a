"""Scrapes the operations page's targets every interval and keeps the last minutes of what they said.

One ``Round`` per interval holds every target's samples, so rates and percentiles compare the same moments
across services. Scraping runs in threads (urllib: the edge has no HTTP client of its own), all targets
at once, each with a timeout shorter than the interval.
"""

from __future__ import annotations

import asyncio
import logging
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from edge.ops.settings import MetricsTarget, OpsSettings

log = logging.getLogger(__name__)
Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Scrape:
    """One target's answer: its samples by name (``_total``, ``_bucket`` ... included), or why not."""

    samples: dict[str, dict[Labels, float]] = field(default_factory=dict)
    error: str = ""

    @property
    def up(self) -> bool:
        return not self.error


@dataclass(frozen=True)
class Round:
    at: float  # time.time() when the round started
    scrapes: dict[str, Scrape]  # by target name

    def series(self, name: str) -> Iterator[tuple[str, Labels, float]]:
        """Every (target, labels, value) of the sample ``name``, over all targets."""
        for target, scrape in self.scrapes.items():
            for labels, value in scrape.samples.get(name, {}).items():
                yield target, labels, value


def parse(text: str) -> dict[str, dict[Labels, float]]:
    samples: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def scrape(target: MetricsTarget, timeout_s: float) -> Scrape:
    try:
        with urllib.request.urlopen(target.url, timeout=timeout_s) as reply:
            return Scrape(parse(reply.read().decode("utf-8")))
    except (OSError, ValueError) as exc:  # refused, timed out, HTTP error, not Prometheus text
        return Scrape(error=f"{type(exc).__name__}: {exc}")


class Scraper:
    def __init__(self, settings: OpsSettings) -> None:
        self.settings = settings
        self.rounds: deque[Round] = deque(maxlen=max(2, int(settings.history_s / settings.scrape_interval_s)))

    async def scrape_round(self) -> Round:
        at = time.time()
        timeout_s = max(0.2, self.settings.scrape_interval_s * 0.8)
        targets = self.settings.metrics_targets
        answers = await asyncio.gather(*(asyncio.to_thread(scrape, t, timeout_s) for t in targets))
        scraped = Round(at, {target.name: answer for target, answer in zip(targets, answers, strict=True)})
        self.rounds.append(scraped)
        return scraped

    async def run(self) -> None:
        """Scrapes every interval until cancelled."""
        if not self.settings.metrics_targets:
            return
        while True:
            started = time.monotonic()
            try:
                await self.scrape_round()
            except Exception:  # a bug here must not stop the page for good; say it and go on
                log.exception("scraping the operations page's targets failed")
            await asyncio.sleep(max(0.0, self.settings.scrape_interval_s - (time.monotonic() - started)))
