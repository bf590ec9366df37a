"""What the chaos suite found, per fault kind: the table it prints and the JSON it writes.

An answer belongs to the first fault injected while it was open (sent, not yet ended): a fault's
victims may end much later (an orchestrator's runs are reaped 15-20 s after it died), by then in
another fault's window. An answer no fault hit belongs to the last fault before it was sent (it ran
while the mesh recovered), or to the ``none (baseline)`` row, before the first fault. Per row:

  injected     faults of this kind done
  answers      answers of the row; completed: those whose stream reached ``done``
  gaps         sequence numbers a client never got (between 1 and the last it saw)
  dups         events a client got more than once
  stored!=     answers whose stored assistant message differs from the streamed text (byte for byte),
               or is missing although the stream completed
  lost         acknowledged messages (the user's message of a run that started) missing from the chat
  errors       what a user would see: answers that ended in an error or never ended, failed calls
  resumes      streams resumed with Last-Event-ID and sends retried (not errors: the page does them)
  recover      seconds from the fault's end until the component was back and a probe answer completed

and of the tool steps of the row's answers (the load's tool share, tool_load.py), from the runs' stored
events and the orchestrators' audit lines (one per execution of a tool, written before it runs):

  steps        tool steps the runs stored (step started events)
  ran          executions of those steps' tools, by any replica
  interrupted  steps whose stored result is "interrupted" (its replica was lost; never run again)
  twice        steps whose tool ran more than once
  step gaps    stored step events a client's stream never delivered, though it got past them
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from localmesh.chaos.clients import Answer, StepEvent
from localmesh.chaos.faults import Injection

BASELINE = "none (baseline)"


@dataclass
class Row:
    kind: str
    injected: int = 0
    answers: int = 0
    completed: int = 0
    gaps: int = 0
    dups: int = 0
    stored_differs: int = 0
    lost: int = 0
    errors: int = 0
    resumes: int = 0
    recover_s: list[float] = field(default_factory=list)
    not_recovered: int = 0
    steps: int = 0
    ran: int = 0
    interrupted: int = 0
    twice: int = 0
    step_gaps: int = 0
    # A few of the errors users saw, to read.
    error_samples: list[str] = field(default_factory=list)

    def recover(self) -> str:
        if not self.injected:
            return "-"
        times = self.recover_s
        text = f"{statistics.median(times):.1f} / {max(times):.1f}" if times else "-"
        return text + (f" ({self.not_recovered} never)" if self.not_recovered else "")


@dataclass(frozen=True)
class Check:
    """One answer against the stored chat."""

    stored_differs: bool
    lost: bool


def check(answer: Answer, by_run: dict[str, dict], user_messages: set[str]) -> Check:
    stored = by_run.get(answer.run_id) if answer.run_id else None
    differs = (answer.completed or stored is not None) and (
        stored is None or stored["content"] != answer.text
    )
    lost = bool(answer.user_message_id) and answer.user_message_id not in user_messages
    return Check(differs, lost or (answer.completed and stored is None))


@dataclass(frozen=True)
class ToolRecord:
    """What happened to the tool steps: the step events each run stored (run id -> events), and how
    many times each call's tool ran (call id -> executions)."""

    stored: dict[str, list[StepEvent]] = field(default_factory=dict)
    executions: Counter[str] = field(default_factory=Counter)

    def count(self, answer: Answer, row: Row) -> None:
        stored = self.stored.get(answer.run_id, [])
        started = [event.call_id for event in stored if event.kind == "step_started"]
        row.steps += len(started)
        row.ran += sum(self.executions[call] for call in started)
        row.twice += sum(1 for call in started if self.executions[call] > 1)
        row.interrupted += sum(1 for event in stored if event.outcome == "interrupted")
        got = set(answer.steps)
        row.step_gaps += sum(1 for event in stored if event.seq <= answer.last_seq and event not in got)


def tabulate(
    injections: list[Injection],
    answers: list[Answer],
    failures: list[tuple[float, str]],
    messages: list[dict],
    tools: ToolRecord | None = None,
) -> list[Row]:
    by_run = {m["run_id"]: m for m in messages if m["role"] == "assistant" and m.get("run_id")}
    user_messages = {m["message_id"] for m in messages if m["role"] == "user"}
    rows: dict[str, Row] = {BASELINE: Row(BASELINE)}
    for injection in injections:
        row = rows.setdefault(injection.fault.kind, Row(injection.fault.kind))
        row.injected += 1
        if injection.recover_s is None:
            row.not_recovered += 1
        else:
            row.recover_s.append(injection.recover_s)
    starts = sorted((injection.injected_at, injection.fault.kind) for injection in injections)

    def last_before(at: float) -> Row:
        kinds = [kind for started, kind in starts if started <= at]
        return rows[kinds[-1] if kinds else BASELINE]

    def row_of(answer: Answer) -> Row:
        hits = [kind for started, kind in starts if answer.sent_at <= started <= answer.ended_at]
        return rows[hits[0]] if hits else last_before(answer.sent_at)

    for answer in answers:
        row = row_of(answer)
        row.answers += 1
        row.completed += answer.completed
        row.gaps += answer.gaps
        row.dups += answer.duplicates
        row.resumes += answer.resumes + answer.retries
        verdict = check(answer, by_run, user_messages)
        row.stored_differs += verdict.stored_differs
        row.lost += verdict.lost
        if tools is not None:
            tools.count(answer, row)
        if not answer.completed:
            row.errors += 1
            if len(row.error_samples) < 5:
                row.error_samples.append(answer.error)
    for at, failure in failures:
        row = last_before(at)
        row.errors += 1
        if len(row.error_samples) < 5:
            row.error_samples.append(failure)
    return list(rows.values())


HEADER = (
    f"{'fault':<18} {'injected':>8} {'answers':>7} {'completed':>9} {'gaps':>5} {'dups':>5} "
    f"{'stored!=':>8} {'lost':>5} {'errors':>6} {'resumes':>7}  {'recover p50 / max (s)':<21} "
    f"{'steps':>5} {'ran':>5} {'interrupted':>11} {'twice':>5} {'step gaps':>9}"
)


def table(rows: list[Row]) -> str:
    lines = [HEADER, "-" * len(HEADER)]
    for r in rows:
        lines.append(
            f"{r.kind:<18} {r.injected:>8} {r.answers:>7} {r.completed:>9} {r.gaps:>5} {r.dups:>5} "
            f"{r.stored_differs:>8} {r.lost:>5} {r.errors:>6} {r.resumes:>7}  {r.recover():<21} "
            f"{r.steps:>5} {r.ran:>5} {r.interrupted:>11} {r.twice:>5} {r.step_gaps:>9}"
        )
    return "\n".join(lines)


def markdown(rows: list[Row]) -> str:
    """The table as docs/benchmarks/chaos.md shows it."""
    head = (
        "| fault | injected | answers | completed | gaps | dups | stored ≠ streamed | lost | errors | resumes "
        "| recover p50 / max (s) | tool steps | ran | interrupted | ran twice | step gaps |"
    )
    lines = [head, "|" + "---|" * 16]
    for r in rows:
        lines.append(
            f"| {r.kind} | {r.injected} | {r.answers} | {r.completed} | {r.gaps} | {r.dups} | "
            f"{r.stored_differs} | {r.lost} | {r.errors} | {r.resumes} | {r.recover()} | {r.steps} | "
            f"{r.ran} | {r.interrupted} | {r.twice} | {r.step_gaps} |"
        )
    return "\n".join(lines)


def write_json(path: Path, context: dict, rows: list[Row], injections: list[Injection]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {
        **context,
        "rows": [asdict(row) for row in rows],
        "injections": [
            {
                "fault": i.fault.kind,
                "target": i.target,
                "fault_s": round(i.over_at - i.injected_at, 3),
                "recover_s": i.recover_s,
            }
            for i in injections
        ],
    }
    path.write_text(json.dumps(result, indent=2) + "\n")
