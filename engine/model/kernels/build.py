"""Builds the native kernel library from the C sources beside this file, with the system's gcc.

Two builds of the same sources: AVX-512 (with the VNNI int8 GEMM) and AVX2 (+FMA, F16C; no int8 GEMM);
the loader asks a small probe library which one this CPU runs. Each is named after a digest of its
sources and flags, so an edited source is rebuilt on next use and two checkouts never load each other's
build. `make setup` builds both (`python -m engine.model.kernels`: an image built on one CPU runs on
another); a runner that finds its build missing compiles it on first use; without gcc or on a CPU or
architecture neither supports, the runner uses the numpy kernels instead and says so.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_DIR = Path(__file__).parent
SOURCES = ("gemm.c", "attention.c", "layer_stack.c", "pool.c", "tp_barrier.c")
HEADERS = ("pool.h", "simd16.h")
# Compiled without ISA flags, so it can be loaded and asked about the CPU on any x86-64: alone (the probe
# that picks a build) and inside each build.
CPU_CHECK_SOURCE = "cpu_check.c"
CPU_CHECK_UNIT = (CPU_CHECK_SOURCE, ("-O2", "-fPIC"))
# -ffp-contract=off: a*b+c stays two roundings unless the code asks for an FMA (dequantization must
# match gguf's float32 arithmetic bit for bit).
BASE_FLAGS = ("-O3", "-fPIC", "-pthread", "-ffp-contract=off")


@dataclass(frozen=True)
class Isa:
    """One build of the kernels: the same sources (simd16.h maps their vectors onto the ISA)."""

    name: str
    flags: tuple[str, ...]
    extra_sources: tuple[str, ...] = ()
    extra_flags: dict[str, tuple[str, ...]] = field(default_factory=dict)


ISAS = {
    # Only the int8 GEMM may use VNNI: the rest of the library must run on AVX-512 CPUs without it.
    "avx512": Isa(
        "avx512",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCM_WITH_GEMM_Q8"),
        extra_sources=("gemm_q8.c",),
        extra_flags={"gemm_q8.c": ("-mavx512vnni",)},
    ),
    "avx2": Isa("avx2", ("-mavx2", "-mfma", "-mf16c")),
}


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


def _digest(flags: tuple[str, ...], sources: tuple[str, ...]) -> str:
    digest = hashlib.sha256(" ".join(flags).encode())
    for name in sources:
        digest.update((SOURCE_DIR / name).read_bytes())
    return digest.hexdigest()[:12]


def library_path(isa: Isa) -> Path:
    flags = isa.flags + sum(isa.extra_flags.values(), ())
    sources = (*SOURCES, *isa.extra_sources, *HEADERS, CPU_CHECK_SOURCE)
    return build_dir() / f"libchatmesh_kernels-{isa.name}-{_digest(BASE_FLAGS + flags, sources)}.so"


def probe_path() -> Path:
    return build_dir() / f"libchatmesh_cpu_check-{_digest(CPU_CHECK_UNIT[1], (CPU_CHECK_SOURCE,))}.so"


def ensure_built(isa: Isa, verbose: bool = False) -> Path:
    """Path of the up-to-date library for ``isa``, compiling it first if needed. Raises KernelBuildError."""
    units = [(n, BASE_FLAGS + isa.flags + isa.extra_flags.get(n, ())) for n in (*SOURCES, *isa.extra_sources)]
    return _ensure(library_path(isa), [*units, CPU_CHECK_UNIT], verbose)


def ensure_probe_built() -> Path:
    """The CPU check alone (``cm_cpu_level``), to choose a build before loading one."""
    return _ensure(probe_path(), [CPU_CHECK_UNIT], verbose=False)


def _ensure(target: Path, units: list[tuple[str, tuple[str, ...]]], verbose: bool) -> Path:
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
        for name, flags in units:
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
