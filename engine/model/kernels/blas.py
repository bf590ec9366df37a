"""numpy's BLAS (OpenBLAS in numpy's wheels) held to one thread where the native kernels own the cores.

The embedding engine's attention runs numpy matmuls per input beside the native GEMMs' thread pool; left
to its default, OpenBLAS starts a thread per core for each of those small products and the two pools
fight over the same cores: a 256-token input's attention took ~25 times longer on this 2-core machine
(docs/benchmarks/embeddings.md). One BLAS thread per call is what those products need.

numpy has no API for it, so the setter is looked up in the OpenBLAS library the process has loaded
(``/proc/self/maps``), as threadpoolctl does.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The setter's name in numpy's own build (scipy-openblas, 64-bit ints), then in a system OpenBLAS.
_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads")


def limit_blas_threads(threads: int = 1) -> bool:
    """Sets every loaded OpenBLAS to ``threads`` threads; False where none is found (another BLAS, or
    not Linux): nothing changes then."""
    import numpy  # noqa: F401  (loads its BLAS, whose path the maps then show)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    libraries = {
        line.split()[-1] for line in maps.splitlines() if "openblas" in line.rsplit("/", 1)[-1].lower()
    }
    done = False
    for path in sorted(libraries):
        library = ctypes.CDLL(path)
        for name in _SETTERS:
            setter = getattr(library, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                done = True
                break
    if not done:
        log.info("no OpenBLAS thread setter found; numpy's BLAS keeps its own threads")
    return done
