"""``python -m engine.model.kernels``: builds the native kernels, both ISAs' builds (run by `make setup`
and the image build, which may run on another CPU than the one serving), and says which kernels the CPU
runner will use on this machine. Never fails provisioning: numpy is the fallback."""

from __future__ import annotations

from engine.model.kernels.build import ISAS, KernelBuildError, ensure_built
from engine.model.kernels.native import NativeKernels, NativeUnavailable

try:
    for isa in ISAS.values():
        ensure_built(isa, verbose=True)
    kernels = NativeKernels()
    print(f"native kernels: ready, the {kernels.isa} build")
except (KernelBuildError, NativeUnavailable) as exc:
    print(f"native kernels: unavailable, the CPU runner will use numpy ({exc})")
