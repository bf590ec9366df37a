"""matplotlib for the benchmarks' plots, when it is installed (the ``bench`` extra)."""

from __future__ import annotations

from types import ModuleType


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` drawing to files (Agg), or None (said once) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; `.venv/bin/pip install matplotlib==3.11.2`)")
        return None
    return plt
