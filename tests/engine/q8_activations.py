"""Q8 activations in numpy: how the CPU engine's native-int8 GEMM (gemm_q8.c) rounds a quantized matrix's
input, which the reference forward reproduces.

Before a weight matrix stored as Q4_1, Q5_0 or Q8_0 (Q5_0 runs as the Q8_0 it equals) multiplies an
activation row, the native GEMM rounds that row to int8 codes per block of 32 values (scale = max|x| / 127,
code = round-half-even(x / scale)) and multiplies codes by codes with VNNI, as llama.cpp does for these
formats; before a Q4_K or Q6_K matrix, per block of 256 values as llama.cpp's Q8_K (scale = max / -127
with the sign of the value of largest magnitude). Every row is rounded on its own, so the result does not
depend on the batch. ``round_input`` gives the values those codes stand for; the reference forward
(``q8_activations=True``) multiplies them in float32 to compute the same model.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QType

QK = 32  # values per activation block (= the weights' quant block)
QK_K = 256  # per K-quant activation block (llama.cpp's Q8_K)
Q8_ACTIVATION_TYPES = frozenset({QType.Q4_1, QType.Q5_0, QType.Q8_0})
Q8_K_ACTIVATION_TYPES = frozenset({QType.Q4_K, QType.Q6_K})


def round_input(x: np.ndarray, qtype: QType) -> np.ndarray:
    """``x`` as the native-int8 GEMM rounds the input of a matrix stored as ``qtype``."""
    if qtype in Q8_ACTIVATION_TYPES:
        return round_to_q8(x)
    if qtype in Q8_K_ACTIVATION_TYPES:
        return round_to_q8_k(x)
    return x


def round_to_q8(x: np.ndarray) -> np.ndarray:
    """float32 ``[T, K]`` (K a multiple of 32) → the same shape, each 32-block rounded to its Q8 codes."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // QK, QK)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = amax / np.float32(127)
    inverse = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=amax > 0)
    return (np.rint(blocks * inverse) * scale).reshape(rows, k)


def round_to_q8_k(x: np.ndarray) -> np.ndarray:
    """float32 ``[T, K]`` (K a multiple of 256) → the same shape, each 256-block rounded to Q8_K codes."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // QK_K, QK_K)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1)[..., None], axis=-1)
    iscale = np.divide(np.float32(-127), largest, out=np.zeros_like(largest), where=largest != 0)
    scale = np.divide(np.float32(1), iscale, out=np.zeros_like(iscale), where=iscale != 0)
    codes = np.minimum(np.rint(iscale * blocks), np.float32(127))
    return (codes * scale).reshape(rows, k)
