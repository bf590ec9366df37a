"""Builds the native kernel library from the C sources beside this file, with the system's gcc.

The library is named after a digest of its sources and flags, so an edited source is rebuilt on next use
and two checkouts never load each other's build. `make setup` builds it (`python -m engine.model.kernels`);
a runner that finds it missing builds it on first use; without gcc or on a CPU/architecture it does not
support, the runner uses the numpy kernels instead and says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
SOURCES = ("gemm.c", "gemm_q8.c", "attention.c", "layer_stack.c", "pool.c", "tp_barrier.c")
# Only the int8 GEMM may use VNNI: the rest of the library must run on AVX-512 CPUs without it.
EXTRA_FLAGS = {"gemm_q8.c": ("-mavx512vnni",)}
HEADERS = ("pool.h",)
# Compiled without ISA flags, so the library can be loaded and asked about the CPU on any x86-64.
CPU_CHECK_SOURCE = "cpu_check.c"
# -ffp-contract=off: a*b+c stays two roundings unless the code asks for an FMA (dequantization must
# match gguf's float32 arithmetic bit for bit).
CFLAGS = (
    "-O3",
    "-fPIC",
    "-pthread",
    "-ffp-contract=off",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mfma",
    "-mf16c",
)


class KernelBuildError(RuntimeError):
    pass


def build_dir() -> Path:
    """Beside the sources when writable (a checkout), else the user's cache (a read-only install)."""
    override = os.environ.get("CHATMESH_KERNEL_BUILD_DIR")
    if override:
        return Path(override)
    local = SOURCE_DIR / "build"
    if os.access(SOURCE_DIR, os.W_OK):
        return local
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "chatmesh" / "kernels"


def library_path() -> Path:
    digest = hashlib.sha256(" ".join(CFLAGS + sum(EXTRA_FLAGS.values(), ())).encode())
    for name in (*SOURCES, *HEADERS, CPU_CHECK_SOURCE):
        digest.update((SOURCE_DIR / name).read_bytes())
    return build_dir() / f"libchatmesh_kernels-{digest.hexdigest()[:12]}.so"


def ensure_built(verbose: bool = False) -> Path:
    """Path of the up-to-date library, compiling it first if needed. Raises KernelBuildError."""
    target = library_path()
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise KernelBuildError(
            "gcc not found: install it (Debian: apt-get install gcc) and rerun `make setup`"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    if verbose:
        print(f"compiling native kernels with {compiler} -> {target}", flush=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = []
        for name, flags in [(n, CFLAGS + EXTRA_FLAGS.get(n, ())) for n in SOURCES] + [
            (CPU_CHECK_SOURCE, ("-O2", "-fPIC"))
        ]:
            obj = Path(tmp) / (name + ".o")
            _run([compiler, *flags, "-c", str(SOURCE_DIR / name), "-o", str(obj)])
            objects.append(str(obj))
        partial = Path(tmp) / target.name
        _run([compiler, "-shared", "-pthread", *objects, "-o", str(partial)])
        os.replace(partial, target)  # atomic: a concurrent builder or loader never sees half a file
    return target


def _run(cmd: list[str]) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise KernelBuildError(f"{' '.join(cmd)} failed:\n{result.stderr.strip()}")
