"""Numeric kernels of the CPU runner, in two interchangeable implementations.

``native``: C (gemm.c, attention.c) in an AVX-512 build and an AVX2 one (simd16.h: the same lane
arithmetic either way), built by gcc at `make setup` or first use, loaded with ctypes; batch-invariant
(results per sequence are bit-identical whatever the batch); float32 activations, the reference
forward's numbers. ``native-int8``: the same, but quantized weights (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
multiply activations rounded to 8 bits per 32-value block (per 256 before Q4_K/Q6_K; gemm_q8.c, AVX-512
VNNI), as llama.cpp computes these formats: about twice the throughput, still batch-invariant (each row is rounded on
its own), and greedy answers that differ from float32's on near-ties (docs/benchmarks/engine.md, "int8 and greedy answers").
``numpy``: plain numpy/OpenBLAS, float32, correct on any CPU numpy runs on, but not batch-invariant:
the fallback where neither build runs (not x86-64, or older than AVX2). ``select_kernels("auto")``, the
default, takes the fastest this CPU and build allow: native-int8, else native, else numpy, logging why.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from engine.model.checkpoint import LlamaConfig, RopeTables, WeightMatrix
from engine.model.step_batch import StepBatch

log = logging.getLogger(__name__)


class Kernels(Protocol):
    name: str  # "native" | "native-int8" | "numpy"
    q8_activations: bool  # quantized weights see their input rounded to Q8 blocks (gemm_q8.c)

    def pack(self, matrix: WeightMatrix) -> object:
        """The matrix in this implementation's own layout (done once at load)."""
        ...

    def linear(self, x: np.ndarray, packed: Any) -> np.ndarray:
        """x [T, in] float32 → x @ W.T [T, out] float32."""
        ...

    def layer_stack(
        self, layers: list, k_cache: list, v_cache: list, tables: list[RopeTables], config: LlamaConfig
    ) -> Callable[[np.ndarray, StepBatch], None] | None:
        """Every decoder layer of a step in one call, ``stack(x, batch)`` updating x [T, hidden] in
        place, bit-identical to the runner's per-kernel loop; or None: the runner runs that loop.
        ``tables``: each layer's RoPE tables."""
        ...

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray: ...

    def rope(self, qkv: np.ndarray, positions: np.ndarray, tables: RopeTables, config: LlamaConfig) -> None:
        """Rotates, in place, the q and k heads (the leading ``num_heads + num_kv_heads``) of every row."""
        ...

    def attention(
        self,
        qkv: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        batch: StepBatch,
        config: LlamaConfig,
        window: int = 0,
    ) -> np.ndarray:
        """Causal attention of every token's query heads (the leading columns of ``qkv``) over its own
        sequence's cached K/V (float16), positions 0..pos (``window`` > 0: only the last ``window`` of
        them, pos itself included). Returns [T, num_heads * head_dim]."""
        ...

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """[T, 2F] (gate | up) → silu(gate) * up, [T, F]."""
        ...

    def gelu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        """[T, 2F] (gate | up) → gelu(gate) * up with GELU's tanh approximation, [T, F]."""
        ...


def select_kernels(
    name: str | None = None, num_threads: int | None = None, config: LlamaConfig | None = None
) -> Kernels:
    """``name``: "native", "native-int8", "numpy" or "auto" (default: $CHATMESH_ENGINE_KERNELS, else
    "auto": native-int8 where AVX-512 VNNI allows, else native, else numpy).
    ``config``: the model the kernels will run, checked against the native kernels' shape limits."""
    from engine.model.kernels.numpy_kernels import NumpyKernels

    name = name or os.environ.get("CHATMESH_ENGINE_KERNELS", "auto")
    if name == "numpy":
        return NumpyKernels()
    if name not in ("native", "native-int8", "auto"):
        raise ValueError(f"unknown kernels {name!r}: use native, native-int8, numpy or auto")
    from engine.model.kernels.native import NativeKernels, NativeUnavailable, NoVnni

    tried = {"native": (False,), "native-int8": (True,), "auto": (True, False)}[name]
    for q8_activations in tried:
        try:
            kernels = NativeKernels(num_threads, q8_activations=q8_activations)
            if config is not None:
                kernels.check_shapes(config)
            return kernels
        except NoVnni as exc:
            if name != "auto":
                raise
            log.info("%s; using native (float32 activations)", exc)
        except NativeUnavailable as exc:
            # Not built, neither AVX-512 nor AVX2, or a model outside their limits: no native set runs.
            if name != "auto":
                raise
            log.warning(
                "native kernels unavailable (%s); using numpy kernels: several times slower, and not "
                "batch-invariant (a sampled answer continued after a failover may part from what was "
                "streamed)",
                exc,
            )
            break
    return NumpyKernels()
