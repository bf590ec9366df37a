"""The line every benchmark prints first: the machine that ran it, and how busy it was at the start."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        cpu = next(
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        )
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {os.cpu_count()} cores, {memory_gib:.0f} GiB, load average {os.getloadavg()[0]:.1f}, "
        f"Python {platform.python_version()}"
    )
