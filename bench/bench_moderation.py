"""What output moderation costs per delta: the policy over every delta's whole window, side by side with
the orchestrator's ``OutputScreen`` (the policy asked only while one of its anchors is in the window).

Every streamed token of every answer is screened, so this is paid per token in the orchestrator. Two
texts, cut into deltas of one word: prose with no anchor (the null engine's text) and the same prose
with numbers in it (digits are the PII patterns' anchors, so those windows are checked in full). The
default rules plus one site-blocked term, as ``--moderation-blocked-term`` adds; medians of the runs.

    .venv/bin/python bench/bench_moderation.py [--deltas 20000] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from engine.model.loading import NULL_TEXT  # noqa: E402
from orchestrator.config import ModerationConfig  # noqa: E402
from orchestrator.policy.moderation import Moderator, OutputScreen, RuleBasedPolicy  # noqa: E402

TEXTS = {
    "prose": NULL_TEXT,
    "prose with numbers": NULL_TEXT + " Call 555-010-4477 before 9 or after 17, room 1204.",
}


def deltas_of(text: str, count: int) -> list[str]:
    words = [f" {word}" for word in text.split()]
    return (words * (count // len(words) + 1))[:count]


def whole_windows(policy: RuleBasedPolicy, deltas: list[str]) -> None:
    """What the screen did before anchors: the policy over every delta's whole window."""
    tail = ""
    for delta in deltas:
        window = tail + delta
        tail = window[-OutputScreen.TAIL_CHARS :]
        policy.check_output(window)


def screened(policy: RuleBasedPolicy, deltas: list[str]) -> None:
    screen = Moderator(policy).output_screen("bench")
    for delta in deltas:
        screen.check(delta)


def median_us_per_delta(
    way: Callable[[RuleBasedPolicy, list[str]], None], deltas: list[str], runs: int
) -> float:
    policy = RuleBasedPolicy.from_config(ModerationConfig(blocked_terms=("project nightingale",)))
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        way(policy, deltas)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / len(deltas) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--deltas", type=int, default=20_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"{args.deltas:,} deltas of one word, median of {args.runs} runs, µs per delta")
    print(f"{'text':<20} {'whole window':>13} {'anchored screen':>16} {'ratio':>7}")
    for name, text in TEXTS.items():
        deltas = deltas_of(text, args.deltas)
        whole = median_us_per_delta(whole_windows, deltas, args.runs)
        anchored = median_us_per_delta(screened, deltas, args.runs)
        print(f"{name:<20} {whole:>13.2f} {anchored:>16.2f} {anchored / whole:>6.2f}x")


if __name__ == "__main__":
    main()
