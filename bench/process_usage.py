"""CPU time and resident memory of the mesh's processes, read from /proc (Linux), for per-hop costs.

``Usage.of(pids)`` is one reading; the difference of two readings over a window, divided by the tokens
relayed in it, is each process's CPU cost per token. Envoy's worker threads count with their process.
A JVM's JIT compiler threads (Cassandra's) are read apart, as ``<name> JIT``: compiling is work a node
that has served for a while has done once, which a benchmark on a node started minutes ago pays inside
its window (on two cores, C2 took half of Cassandra's CPU in cost-per-send runs after 3,000 warm sends).
"""

from __future__ import annotations

import contextlib
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


# HotSpot's compiler threads, "C1 CompilerThread0" and so on, as Linux names them (15 characters).
_COMPILER_THREADS = ("C1 CompilerThre", "C2 CompilerThre")


def compiler_seconds(pid: int) -> float:
    """CPU time of ``pid``'s JIT compiler threads so far (0 for a process that is not a JVM)."""
    ticks = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # a thread that just ended
            stat = (task / "stat").read_text()
            name, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
            if name.startswith(_COMPILER_THREADS):
                ticks += int(fields[11]) + int(fields[12])
    return ticks / _TICKS_PER_S


def rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * _PAGE_BYTES


@dataclass(frozen=True)
class Usage:
    """One reading: CPU seconds (the JIT compilers' apart) and resident bytes by process name."""

    cpu_s: dict[str, float]
    rss: dict[str, int]
    jit_s: dict[str, float]

    @classmethod
    def of(cls, pids: dict[str, int]) -> Usage:
        return cls(
            {name: cpu_seconds(pid) for name, pid in pids.items()},
            {name: rss_bytes(pid) for name, pid in pids.items()},
            {name: compiler_seconds(pid) for name, pid in pids.items()},
        )

    def cpu_since(self, earlier: Usage) -> dict[str, float]:
        """Each process's CPU since ``earlier`` less its JIT compilers', which a JVM's ``<name> JIT`` holds."""
        used = {}
        for name in self.cpu_s:
            jit = self.jit_s[name] - earlier.jit_s[name]
            used[name] = self.cpu_s[name] - earlier.cpu_s[name] - jit
            if self.jit_s[name]:
                used[f"{name} JIT"] = jit
        return used

    def rss_since(self, earlier: Usage) -> dict[str, int]:
        return {name: self.rss[name] - earlier.rss[name] for name in self.rss}

    def peak(self, other: Usage) -> Usage:
        """The larger resident size of each process (CPU from ``other``, the later reading)."""
        return Usage(
            other.cpu_s, {name: max(self.rss[name], other.rss[name]) for name in self.rss}, other.jit_s
        )
