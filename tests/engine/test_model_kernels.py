"""The native kernels against the numpy kernels (and gguf's dequantization) on synthetic data."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QType
from gguf import quants

from engine.model import kernels as kernels_module
from engine.model.checkpoint import LlamaConfig, WeightMatrix, rope_tables
from engine.model.kernels import select_kernels
from engine.model.kernels.build import ISAS, ensure_built
from engine.model.kernels.native import NativeKernels, NativeUnavailable, NoVnni, load_library
from engine.model.kernels.numpy_kernels import NumpyKernels
from engine.model.kernels.packing import (
    FORMAT_F32,
    FORMAT_Q4_1,
    FORMAT_Q4_1_VNNI,
    FORMAT_Q4_K_VNNI,
    FORMAT_Q6_K_VNNI,
    FORMAT_Q8_0,
    FORMAT_Q8_0_VNNI,
)
from engine.model.runner import SequenceChunk
from engine.model.step_batch import build_step_batch
from tests.engine.q8_activations import round_input, round_to_q8, round_to_q8_k
from tests.fixtures.model import require_native

RNG = np.random.default_rng(1234)
# SmolLM2's attention shape: 9 query heads in 3 GQA groups of head_dim 64.
SHAPE = LlamaConfig("test", 1, 576, 1536, 9, 3, 64, 1000, 4096, 10000.0, 1e-5)


@pytest.fixture(scope="module")
def native() -> NativeKernels:
    require_native()
    return NativeKernels(num_threads=2)


@pytest.fixture(scope="module")
def native_int8() -> NativeKernels:
    require_native(int8=True)
    return NativeKernels(num_threads=2, q8_activations=True)


# K-quant super-blocks (gguf cannot quantize to them): bytes, and where each holds its f16 super-scales.
K_QUANT_LAYOUT = {QType.Q4_K: (144, (0, 2)), QType.Q6_K: (210, (208,))}


def random_matrix(qtype: QType, out_features: int, in_features: int) -> WeightMatrix:
    if qtype in K_QUANT_LAYOUT:  # random codes and sub-block scales, finite super-block scales
        block_bytes, scale_offsets = K_QUANT_LAYOUT[qtype]
        blocks = RNG.integers(0, 256, (out_features * in_features // 256, block_bytes), dtype=np.uint8)
        for offset in scale_offsets:
            scales = (RNG.standard_normal(len(blocks)) * 0.01).astype(np.float16)
            blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
        return WeightMatrix("w", qtype, (out_features, in_features), blocks.reshape(out_features, -1))
    values = RNG.standard_normal((out_features, in_features)).astype(np.float32)
    if qtype == QType.F32:
        return WeightMatrix("w", qtype, values.shape, values)
    return WeightMatrix("w", qtype, values.shape, quants.quantize(values, qtype))


def in_features_for(qtype: QType) -> int:
    """A row length the type allows (K-quants: whole 256-value super-blocks) with several blocks."""
    return 512 if qtype in K_QUANT_LAYOUT else 96


@pytest.mark.parametrize(
    ("qtype", "fmt", "int8"),
    [
        (QType.Q4_1, FORMAT_Q4_1, False),
        (QType.Q8_0, FORMAT_Q8_0, False),
        (QType.F16, FORMAT_F32, False),
        (QType.Q5_0, FORMAT_Q8_0, False),  # as the Q8_0 it equals
        (QType.Q4_K, FORMAT_F32, False),
        (QType.Q4_1, FORMAT_Q4_1_VNNI, True),
        (QType.Q8_0, FORMAT_Q8_0_VNNI, True),
        (QType.Q5_0, FORMAT_Q8_0_VNNI, True),
        (QType.Q4_K, FORMAT_Q4_K_VNNI, True),
        (QType.Q6_K, FORMAT_Q6_K_VNNI, True),
    ],
)
def test_packed_weights_expand_to_exactly_ggufs_dequantized_values(request, qtype, fmt, int8):
    kernels = request.getfixturevalue("native_int8" if int8 else "native")
    k = in_features_for(qtype)
    matrix = random_matrix(qtype, 40, k)  # 40 rows: two full panels and a partial one
    packed = kernels.pack(matrix)
    assert packed.fmt == fmt
    if fmt == FORMAT_F32:
        unpacked = packed.data.transpose(0, 2, 1).reshape(-1, k)[:40]
    else:
        unpacked = kernels.unpack(packed)
    np.testing.assert_array_equal(unpacked, matrix.dequantize())


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.F32])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_native_linear_matches_float32_matmul(native, qtype, rows):
    matrix = random_matrix(qtype, 200, 160)  # 200 outputs: an odd number of 16-row panels, one partial
    x = RNG.standard_normal((rows, 160)).astype(np.float32)
    expected = x.astype(np.float64) @ matrix.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(native.linear(x, native.pack(matrix)), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q5_0, QType.Q4_K, QType.Q6_K, QType.F32])
@pytest.mark.parametrize("rows", [1, 5, 13, 40])
def test_int8_linear_matches_float32_matmul_of_q8_rounded_activations(native_int8, qtype, rows):
    # Quantized types: int8 codes of x times the weights' codes; exact integer sums, so within float32
    # rounding of round_input(x) @ W.T (Q8 blocks of 32, or of 256 before K-quants, as llama.cpp rounds).
    # Other formats: float32 x @ W.T, as in the float32 kernels.
    k = 512 if qtype in K_QUANT_LAYOUT else 160
    matrix = random_matrix(qtype, 200, k)
    x = RNG.standard_normal((rows, k)).astype(np.float32)
    seen = round_input(x, qtype)
    expected = seen.astype(np.float64) @ matrix.dequantize().T.astype(np.float64)
    np.testing.assert_allclose(
        native_int8.linear(x, native_int8.pack(matrix)), expected, rtol=1e-4, atol=1e-4
    )


def test_q8_k_rounding_takes_llama_cpps_signed_scale_per_256_values():
    x = RNG.standard_normal((2, 512)).astype(np.float32)
    x[0, 7] = -9.0  # row 0's first block: its largest magnitude is negative, and its code -127
    x[1, 256:] = 0  # an all-zero block stays zero
    rounded = round_to_q8_k(x)
    assert rounded[0, 7] == pytest.approx(-9.0, rel=1e-6)
    step = np.abs(x).reshape(2, 2, 256).max(axis=-1, keepdims=True) / 127
    assert (np.abs(rounded - x).reshape(2, 2, 256) <= step / 2 * (1 + 1e-5)).all()
    assert (rounded[1, 256:] == 0).all()


def test_q8_rounding_keeps_each_block_within_half_a_code():
    x = RNG.standard_normal((3, 96)).astype(np.float32) * np.float32(10)
    x[1, 32:64] = 0  # an all-zero block stays zero
    rounded = round_to_q8(x)
    step = np.abs(x).reshape(3, 3, 32).max(axis=-1, keepdims=True) / 127
    assert (np.abs(rounded - x).reshape(3, 3, 32) <= step / 2 * (1 + 1e-5)).all()
    assert (rounded[1, 32:64] == 0).all()


@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("qtype", [QType.Q4_1, QType.Q8_0, QType.Q4_K, QType.Q6_K])
def test_native_linear_rows_do_not_depend_on_the_rest_of_the_batch(request, qtype, int8):
    kernels = request.getfixturevalue("native_int8" if int8 else "native")
    packed = kernels.pack(random_matrix(qtype, 96, 768))
    x = RNG.standard_normal((37, 768)).astype(np.float32)
    together = kernels.linear(x, packed)
    for i in (0, 12, 36):
        np.testing.assert_array_equal(kernels.linear(x[i : i + 1], packed)[0], together[i])


def step_inputs(block_size: int, chunks: list[tuple[int, int]]):
    """A random paged cache and a step of (start_position, length) chunks on scattered blocks."""
    num_blocks, heads, kv_heads, head_dim = 64, SHAPE.num_heads, SHAPE.num_kv_heads, SHAPE.head_dim
    k_cache = RNG.standard_normal((num_blocks, kv_heads, head_dim, block_size)).astype(np.float16)
    v_cache = RNG.standard_normal((num_blocks, block_size, kv_heads, head_dim)).astype(np.float16)
    free = list(RNG.permutation(num_blocks))
    seq_chunks = []
    for start, length in chunks:
        blocks = [int(free.pop()) for _ in range(-(-(start + length) // block_size))]
        tokens = np.zeros(length, dtype=np.int32)
        seq_chunks.append(SequenceChunk(tokens, start, np.array(blocks, dtype=np.int32), True))
    batch = build_step_batch(seq_chunks, block_size, context_length=4096)
    qkv = RNG.standard_normal((batch.num_tokens, (heads + 2 * kv_heads) * head_dim)).astype(np.float32)
    return qkv, k_cache, v_cache, batch


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_native_paged_attention_matches_numpy(native, block_size):
    # decode tokens, a first prefill chunk, and a later chunk over a cached prefix, in one step
    qkv, k_cache, v_cache, batch = step_inputs(block_size, [(0, 1), (40, 1), (0, 23), (70, 9), (5, 2)])
    args = (qkv, k_cache, v_cache, batch, SHAPE)
    np.testing.assert_allclose(native.attention(*args), NumpyKernels().attention(*args), rtol=1e-5, atol=2e-6)


def test_native_attention_ignores_cache_past_each_tokens_position(native):
    qkv, k_cache, v_cache, batch = step_inputs(16, [(0, 20), (3, 1)])
    before = native.attention(qkv, k_cache, v_cache, batch, SHAPE)
    # Scribble over every position later than any token of the step: nothing may change.
    for row, last in ((0, 19), (1, 3)):
        for pos in range(last + 1, 32):
            block, offset = batch.block_tables[row, pos // 16], pos % 16
            k_cache[block, :, :, offset] = 1e3
            v_cache[block, offset] = -1e3
    np.testing.assert_array_equal(native.attention(qkv, k_cache, v_cache, batch, SHAPE), before)


def test_native_elementwise_kernels_match_numpy(native):
    reference = NumpyKernels()
    x = RNG.standard_normal((7, 576)).astype(np.float32)
    weight = RNG.standard_normal(576).astype(np.float32)
    np.testing.assert_allclose(
        native.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), rtol=1e-5
    )

    gate_up = (RNG.standard_normal((7, 2 * 1536)) * 8).astype(np.float32)
    np.testing.assert_allclose(native.silu_mul(gate_up), reference.silu_mul(gate_up), rtol=1e-5, atol=1e-6)

    positions = np.array([0, 1, 17, 300, 4095, 2, 9], dtype=np.int32)
    tables = rope_tables(SHAPE)
    qkv = RNG.standard_normal((7, 15 * 64)).astype(np.float32)
    ours, theirs = qkv.copy(), qkv.copy()
    native.rope(ours, positions, tables, SHAPE)
    reference.rope(theirs, positions, tables, SHAPE)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ours[:, 12 * 64 :], qkv[:, 12 * 64 :])  # v heads untouched


def test_both_builds_compile_whichever_this_cpu_runs(tmp_path, monkeypatch):
    """An image is built on one CPU and serves on another: the build this CPU does not run must compile
    too (it is only compiled here, never loaded)."""
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here")
    monkeypatch.setenv("CHATMESH_KERNEL_BUILD_DIR", str(tmp_path))
    built = {name: ensure_built(isa) for name, isa in ISAS.items()}
    assert sorted(built) == ["avx2", "avx512"]
    assert all(path.is_file() and path.parent == tmp_path for path in built.values())
    assert len(set(built.values())) == 2


def test_auto_selection_falls_back_to_numpy_when_native_is_unavailable(monkeypatch):
    def unavailable(num_threads=None, q8_activations=False):
        raise NativeUnavailable("no compiler in this test")

    monkeypatch.setattr("engine.model.kernels.native.NativeKernels", unavailable)
    assert select_kernels("auto").name == "numpy"
    with pytest.raises(NativeUnavailable):
        select_kernels("native")
    assert kernels_module.select_kernels("numpy").name == "numpy"


def test_auto_selection_takes_int8_where_vnni_allows_and_float32_activations_where_not(monkeypatch):
    require_native()
    expected = "native-int8" if load_library().cm_cpu_supports_vnni() else "native"
    assert select_kernels("auto").name == expected

    native_kernels = NativeKernels
    attempts: list[bool] = []

    def without_vnni(num_threads=None, q8_activations=False):
        attempts.append(q8_activations)
        if q8_activations:
            raise NoVnni("no VNNI in this test")
        return native_kernels(num_threads)

    monkeypatch.setattr("engine.model.kernels.native.NativeKernels", without_vnni)
    assert select_kernels("auto").name == "native"
    with pytest.raises(NoVnni):
        select_kernels("native-int8")

    # Native kernels that cannot run at all are not tried twice (a failed build is not repeated).
    def unbuildable(num_threads=None, q8_activations=False):
        attempts.append(q8_activations)
        raise NativeUnavailable("no compiler in this test")

    attempts.clear()
    monkeypatch.setattr("engine.model.kernels.native.NativeKernels", unbuildable)
    assert select_kernels("auto").name == "numpy" and attempts == [True]
