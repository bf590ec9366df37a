"""A run's trace from the span file (meshkit.telemetry.SpanRecord lines): the orchestrator tags its
"start run" span with ``chatmesh.run_id``; every span of that span's trace is the run's, from Envoy to
the engine. The file is read from the end, newest runs first, and read in a thread (it can be large)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

RUN_ID_ATTRIBUTE = "chatmesh.run_id"


@dataclass(frozen=True)
class Trace:
    trace_id: str
    spans: list[dict]  # SpanRecord fields, by start time


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with path.open(encoding="utf-8") as f:
        # A line being appended while this reads is cut short: skip it, it is whole next time.
        return [record for line in f if (record := _parse(line)) is not None]


def _parse(line: str) -> dict | None:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def find_run_trace(path: Path, run_id: str) -> Trace | None:
    """The trace of ``run_id``'s start, or None when no span names the run (yet)."""
    records = _records(path)
    trace_id = next(
        (r["trace_id"] for r in reversed(records) if r.get("attributes", {}).get(RUN_ID_ATTRIBUTE) == run_id),
        None,
    )
    if trace_id is None:
        return None
    spans = [r for r in records if r["trace_id"] == trace_id]
    return Trace(trace_id, sorted(spans, key=lambda r: r["start_ns"] or 0))
