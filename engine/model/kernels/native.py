"""ctypes face of the native kernels (gemm.c, gemm_q8.c, attention.c; tp_barrier.c for tensor parallelism),
in the build this CPU runs (AVX-512 or AVX2, see build.py). Weights stay in GGUF's quantized numbers."""

from __future__ import annotations

import ctypes
import functools
import os
import platform

import numpy as np

from engine.model.checkpoint import LlamaConfig, RopeTables, WeightMatrix
from engine.model.kernels.build import ISAS, Isa, KernelBuildError, ensure_built, ensure_probe_built
from engine.model.kernels.packing import FORMAT_F32, NR, VNNI_FORMATS, PackedMatrix, pack
from engine.model.step_batch import StepBatch

_P, _L, _I, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "cm_cpu_level": (ctypes.c_int, []),
    "cm_cpu_supports_vnni": (ctypes.c_int, []),
    "cm_set_threads": (None, [_I]),
    "cm_get_threads": (ctypes.c_int, []),
    "cm_gemm": (None, [_I, _P, _L, _I, _I, _P, _I, _P, _L]),
    "cm_unpack": (None, [_I, _P, _I, _I, _P]),
    "cm_gemm_q8": (None, [_I, _P, _L, _I, _I, _P, _I, _P, _L]),
    "cm_unpack_q8": (None, [_I, _P, _I, _I, _P]),
    "cm_attention": (None, [_P, _L, _I, _I, _I, _I, _P, _P, _I, _P, _P, _P, _I, _I, _I, _F, _P]),
    "cm_rms_norm": (None, [_P, _I, _I, _P, _F, _P]),
    "cm_rope": (None, [_P, _L, _I, _I, _I, _P, _P, _P]),
    "cm_silu_mul": (None, [_P, _I, _I, _P]),
    "cm_gelu_mul": (None, [_P, _I, _I, _P]),
    "cm_layer_stack": (ctypes.c_int, [_P, _P, _P, _I, _P, _P, _P, _P, _I, _I]),
    "cm_tp_arrive": (ctypes.c_uint32, [_P, _I]),
    "cm_tp_wait": (ctypes.c_int, [_P, ctypes.c_uint32, _I]),
}
_INT8_FUNCTIONS = ("cm_gemm_q8", "cm_unpack_q8")  # only the AVX-512 build has them


class _Matrix(ctypes.Structure):
    _fields_ = [("fmt", ctypes.c_int), ("out_features", ctypes.c_int), ("data", _P)]


class _Layer(ctypes.Structure):  # layer_stack.c: cm_layer
    _fields_ = [
        ("attn_norm", _P),
        ("ffn_norm", _P),
        ("qkv", _Matrix),
        ("wo", _Matrix),
        ("gate_up", _Matrix),
        ("down", _Matrix),
        ("k_cache", _P),
        ("v_cache", _P),
        *(
            (name, _P)
            for name in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm", "rope_cos", "rope_sin")
        ),
        ("window", ctypes.c_int),
    ]


class _Model(ctypes.Structure):  # layer_stack.c: cm_model
    _fields_ = [
        *((name, ctypes.c_int) for name in ("num_layers", "hidden", "ffn", "num_heads", "num_kv_heads")),
        ("head_dim", ctypes.c_int),
        ("block_size", ctypes.c_int),
        ("gelu", ctypes.c_int),
        ("eps", _F),
        ("scale", _F),
    ]


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be used: not built (no gcc, compile error) or not supported here."""


class UnsupportedCpu(NativeUnavailable):
    """This machine cannot run them at all (not x86-64, or neither AVX-512 nor AVX2): numpy it is."""


class NoVnni(NativeUnavailable):
    """The CPU runs the native kernels but lacks AVX-512 VNNI, which native-int8 needs."""


@functools.cache
def cpu_isa() -> Isa:
    """The build of the kernels this CPU runs, asked of the probe library. Raises NativeUnavailable."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise UnsupportedCpu(
            f"the native kernels are for x86-64 (AVX-512 or AVX2); this is {platform.machine()}"
        )
    try:
        probe = ctypes.CDLL(str(ensure_probe_built()))
    except (KernelBuildError, OSError) as exc:
        raise NativeUnavailable(str(exc)) from exc
    level = probe.cm_cpu_level()
    if level == 0:
        raise UnsupportedCpu("this CPU has neither AVX-512 (F, BW, VL, DQ) nor AVX2 with FMA and F16C")
    return ISAS["avx512" if level == 2 else "avx2"]


@functools.cache
def load_library() -> ctypes.CDLL:
    """The built library for this CPU. Raises NativeUnavailable saying why not."""
    isa = cpu_isa()
    try:
        lib = ctypes.CDLL(str(ensure_built(isa)))
    except (KernelBuildError, OSError) as exc:
        raise NativeUnavailable(str(exc)) from exc
    for name, (restype, argtypes) in _SIGNATURES.items():
        if name in _INT8_FUNCTIONS and not hasattr(lib, name):
            continue
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def _ptr(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _f32(a: np.ndarray) -> np.ndarray:
    # The C side reads raw float32 rows: a float64 or strided array here would be silently misread.
    assert a.dtype == np.float32 and a.flags.c_contiguous, (a.dtype, a.flags)
    return a


def _f16(a: np.ndarray) -> np.ndarray:
    assert a.dtype == np.float16 and a.flags.c_contiguous, (a.dtype, a.flags)
    return a


class NativeLayerStack:
    """All decoder layers of a step in one C call (layer_stack.c). Holds pointers into the weights, the
    norms, the RoPE tables and the KV cache it was built over: they must outlive it, unchanged."""

    def __init__(
        self,
        lib: ctypes.CDLL,
        layers: list,
        k_cache: list,
        v_cache: list,
        tables: list[RopeTables],
        config: LlamaConfig,
    ) -> None:
        def matrix(m: PackedMatrix) -> _Matrix:
            return _Matrix(m.fmt, m.out_features, _ptr(m.data))

        def optional(weights: np.ndarray | None) -> int | None:
            return None if weights is None else _ptr(_f32(weights))

        self._lib = lib
        self._keep = (layers, k_cache, v_cache, tables)
        self._layers = (_Layer * len(layers))(
            *(
                _Layer(
                    _ptr(_f32(layer.attn_norm)),
                    _ptr(_f32(layer.ffn_norm)),
                    matrix(layer.qkv),
                    matrix(layer.wo),
                    matrix(layer.gate_up),
                    matrix(layer.down),
                    _ptr(_f16(k)),
                    _ptr(_f16(v)),
                    optional(layer.q_norm),
                    optional(layer.k_norm),
                    optional(layer.post_attn_norm),
                    optional(layer.post_ffn_norm),
                    _ptr(_f32(rope.cos)),
                    _ptr(_f32(rope.sin)),
                    config.window(i),
                )
                for i, (layer, k, v, rope) in enumerate(zip(layers, k_cache, v_cache, tables, strict=True))
            )
        )
        self._model = _Model(
            len(layers),
            config.hidden_size,
            config.intermediate_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            v_cache[0].shape[1],
            config.activation == "gelu_tanh",
            config.rms_norm_eps,
            1.0 / float(np.sqrt(config.head_dim)),
        )

    def __call__(self, x: np.ndarray, batch: StepBatch) -> None:
        """Runs every layer over x [T, hidden] in place."""
        _f32(x)
        assert batch.slots.dtype == np.int64 and batch.token_seq.dtype == np.int32
        status = self._lib.cm_layer_stack(
            ctypes.byref(self._model),
            self._layers,
            _ptr(x),
            len(x),
            _ptr(batch.positions),
            _ptr(batch.slots),
            _ptr(batch.token_seq),
            _ptr(batch.block_tables),
            batch.block_tables.shape[1],
            batch.max_len,
        )
        if status != 0:
            raise MemoryError("the layer stack could not allocate its scratch buffers")


class NativeKernels:
    def __init__(self, num_threads: int | None = None, q8_activations: bool = False) -> None:
        """``q8_activations``: quantized weights (Q4_1, Q5_0, Q8_0, Q4_K, Q6_K) multiply activations
        rounded to 8 bits, with VNNI ("native-int8"); else float32 activations (the reference's numbers)."""
        self.q8_activations = q8_activations
        self.name = "native-int8" if q8_activations else "native"
        self.lib = load_library()
        self.isa = cpu_isa().name  # the same numbers either way (simd16.h); for logs and benchmarks
        if q8_activations and not self.lib.cm_cpu_supports_vnni():
            raise NoVnni("native-int8 needs AVX-512 VNNI, which this CPU lacks")
        self.num_threads = num_threads or len(os.sched_getaffinity(0))
        self.lib.cm_set_threads(self.num_threads)

    def check_shapes(self, config: LlamaConfig) -> None:
        """Raises NativeUnavailable for a model outside the C kernels' limits (see attention.c)."""
        group = config.num_heads // config.num_kv_heads
        if config.head_dim % 16 or config.head_dim > 256 or group > 16 or config.hidden_size % 16:
            raise NativeUnavailable(
                f"head_dim {config.head_dim}, {group} query heads per kv head and hidden size "
                f"{config.hidden_size} are outside the native kernels' limits"
            )

    def pack(self, matrix: WeightMatrix) -> PackedMatrix:
        return pack(matrix, int8=self.q8_activations)

    def linear(self, x: np.ndarray, packed: PackedMatrix) -> np.ndarray:
        _f32(x)
        rows = x.shape[0]
        out = np.empty((rows, packed.out_features), dtype=np.float32)
        gemm = self.lib.cm_gemm_q8 if packed.fmt in VNNI_FORMATS else self.lib.cm_gemm
        gemm(
            packed.fmt,
            _ptr(x),
            x.shape[1],
            rows,
            packed.in_features,
            _ptr(packed.data),
            packed.out_features,
            _ptr(out),
            packed.out_features,
        )
        return out

    def layer_stack(
        self, layers: list, k_cache: list, v_cache: list, tables: list[RopeTables], config: LlamaConfig
    ) -> NativeLayerStack:
        return NativeLayerStack(self.lib, layers, k_cache, v_cache, tables, config)

    def unpack(self, packed: PackedMatrix) -> np.ndarray:
        """float32 [out, in] as the GEMM sees it."""
        if packed.fmt == FORMAT_F32:
            panels = packed.data.reshape(-1, packed.in_features, NR).transpose(0, 2, 1)
            return np.ascontiguousarray(panels.reshape(-1, packed.in_features)[: packed.out_features])
        out = np.empty((packed.out_features, packed.in_features), dtype=np.float32)
        unpack = self.lib.cm_unpack_q8 if packed.fmt in VNNI_FORMATS else self.lib.cm_unpack
        unpack(packed.fmt, _ptr(packed.data), packed.in_features, packed.out_features, _ptr(out))
        return out

    def rms_norm(self, x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
        _f32(x)
        out = np.empty_like(x)
        self.lib.cm_rms_norm(_ptr(x), x.shape[0], x.shape[1], _ptr(_f32(weight)), eps, _ptr(out))
        return out

    def rope(self, qkv: np.ndarray, positions: np.ndarray, tables: RopeTables, config: LlamaConfig) -> None:
        _f32(qkv)
        assert positions.dtype == np.int32
        heads = config.num_heads + config.num_kv_heads
        self.lib.cm_rope(
            _ptr(qkv),
            qkv.shape[1],
            len(qkv),
            heads,
            config.head_dim,
            _ptr(positions),
            _ptr(tables.cos),
            _ptr(tables.sin),
        )

    def attention(
        self,
        qkv: np.ndarray,
        k_cache: np.ndarray,
        v_cache: np.ndarray,
        batch: StepBatch,
        config: LlamaConfig,
        window: int = 0,
    ) -> np.ndarray:
        _f32(qkv), _f16(k_cache), _f16(v_cache)
        num_heads, num_kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        out = np.empty((len(qkv), num_heads * head_dim), dtype=np.float32)
        self.lib.cm_attention(
            _ptr(qkv),
            qkv.shape[1],
            len(qkv),
            num_heads,
            num_kv_heads,
            head_dim,
            _ptr(k_cache),
            _ptr(v_cache),
            v_cache.shape[1],  # block_size
            _ptr(batch.token_seq),
            _ptr(batch.positions),
            _ptr(batch.block_tables),
            batch.block_tables.shape[1],
            batch.max_len,
            window,
            1.0 / float(np.sqrt(head_dim)),
            _ptr(out),
        )
        return out

    def silu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        return self._gated(self.lib.cm_silu_mul, gate_up)

    def gelu_mul(self, gate_up: np.ndarray) -> np.ndarray:
        return self._gated(self.lib.cm_gelu_mul, gate_up)

    @staticmethod
    def _gated(kernel, gate_up: np.ndarray) -> np.ndarray:
        _f32(gate_up)
        rows, width = gate_up.shape
        out = np.empty((rows, width // 2), dtype=np.float32)
        kernel(_ptr(gate_up), rows, width // 2, _ptr(out))
        return out
