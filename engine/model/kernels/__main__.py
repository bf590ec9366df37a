"""``python -m engine.model.kernels``: builds the native kernels (run by `make setup`) and says which
kernels the CPU runner will use on this machine. Never fails provisioning: numpy is the fallback."""

from __future__ import annotations

from engine.model.kernels.build import KernelBuildError, ensure_built
from engine.model.kernels.native import NativeKernels, NativeUnavailable

try:
    path = ensure_built(verbose=True)
    NativeKernels()
    print(f"native kernels: ready ({path.name})")
except (KernelBuildError, NativeUnavailable) as exc:
    print(f"native kernels: unavailable, the CPU runner will use numpy ({exc})")
