"""CPU time and resident memory of the mesh's processes, read from /proc (Linux), for per-hop costs.

``Usage.of(pids)`` is one reading; the difference of two readings over a window, divided by the tokens
relayed in it, is each process's CPU cost per token. Envoy's worker threads count with their process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of ``pid`` (all its threads) so far."""
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S  # utime, stime: fields 14 and 15


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_BYTES


@dataclass(frozen=True)
class Usage:
    """One reading: CPU seconds and resident bytes by process name."""

    cpu_s: dict[str, float]
    rss: dict[str, int]

    @classmethod
    def of(cls, pids: dict[str, int]) -> Usage:
        return cls(
            {name: cpu_seconds(pid) for name, pid in pids.items()},
            {name: rss_bytes(pid) for name, pid in pids.items()},
        )

    def cpu_since(self, earlier: Usage) -> dict[str, float]:
        return {name: self.cpu_s[name] - earlier.cpu_s[name] for name in self.cpu_s}

    def rss_since(self, earlier: Usage) -> dict[str, int]:
        return {name: self.rss[name] - earlier.rss[name] for name in self.rss}

    def peak(self, other: Usage) -> Usage:
        """The larger resident size of each process (CPU from ``other``, the later reading)."""
        return Usage(other.cpu_s, {name: max(self.rss[name], other.rss[name]) for name in self.rss})
