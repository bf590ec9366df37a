"""Repacks GGUF weight rows into the native GEMMs' panel layouts, once at load.

A panel is 16 output rows. For the float32 GEMM (gemm.c), k-major, per (panel, 32-k block):
- Q4_1: f16 d[16], f16 m[16], then 16 code pairs of 16 bytes (byte n: low nibble = row k, high = k+1);
- Q8_0: f16 d[16], then 32 rows of 16 int8 codes;
- F32 (every other type, dequantized): the panel is simply float32 [K, 16].
For the int8 GEMM (gemm_q8.c, ``int8=True``), laid out for VPDPBUSD (4 consecutive k of one row in each
32-bit lane), per (panel, 32-k block):
- Q4_1_VNNI: f16 d[16], f16 m[16], then 4 vectors of 64 code bytes: in vector v, byte 4n + i holds row
  n's code for k = 4v + i in its low nibble and for k = 16 + 4v + i in its high nibble;
- Q8_0_VNNI: f16 d[16], then 8 vectors of 64 bytes: in vector g, byte 4n + i is row n's code for
  k = 4g + i plus 128 (unsigned, as VPDPBUSD wants it; the kernel takes the 128 back out exactly);
- Q4_K_VNNI, Q6_K_VNNI: f32 d_lo[16] (the scale of k 0..15), f32 d_hi[16] (k 16..31), f32 m[16], then
  codes as Q8_0_VNNI's, unsigned as stored (Q4_K: q, weight d * q - m; Q6_K: q, weight d * (q - 32),
  m = 0). d and m are the products GGUF's super-block scales and sub-block scales make, exact in
  float32 (an f16 times a 6- or 8-bit integer), so these too hold exactly the file's numbers.
Quantized panels hold exactly GGUF's numbers, so no precision is lost and memory stays the file's size.
Q5_0 (d * (q - 16), q 5-bit) is rewritten as Q8_0 first (``as_q8_0``): the same scale and codes in
[-16, 15] as int8, bit-equal once dequantized, so it takes the Q8_0 paths (34 bytes a block, not 22).
N is padded to a multiple of 16 with zero rows that the kernel never writes out.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf.quants import Q4_K

from engine.model.checkpoint import WeightMatrix

NR = 16  # outputs per panel
QK = 32  # weights per quant block
FORMAT_F32, FORMAT_Q4_1, FORMAT_Q8_0, FORMAT_Q4_1_VNNI, FORMAT_Q8_0_VNNI = 0, 1, 2, 3, 4
FORMAT_Q4_K_VNNI, FORMAT_Q6_K_VNNI = 5, 6
VNNI_FORMATS = (FORMAT_Q4_1_VNNI, FORMAT_Q8_0_VNNI, FORMAT_Q4_K_VNNI, FORMAT_Q6_K_VNNI)


@dataclass(frozen=True)
class PackedMatrix:
    fmt: int
    out_features: int
    in_features: int
    data: np.ndarray  # contiguous bytes or float32, panel after panel


def pack(matrix: WeightMatrix, int8: bool = False) -> PackedMatrix:
    """``int8``: Q4_1/Q5_0/Q8_0/Q4_K/Q6_K in the int8 GEMM's layout; without it Q4_K and Q6_K (and
    every other type but Q4_1, Q5_0, Q8_0) are float32."""
    matrix = as_q8_0(matrix)
    n, k = matrix.shape
    if matrix.qtype == QType.Q4_1:
        if int8:
            return PackedMatrix(FORMAT_Q4_1_VNNI, n, k, _pack_q4_1_vnni(matrix.data, n, k))
        return PackedMatrix(FORMAT_Q4_1, n, k, _pack_q4_1(matrix.data, n, k))
    if matrix.qtype == QType.Q8_0:
        if int8:
            return PackedMatrix(FORMAT_Q8_0_VNNI, n, k, _pack_q8_0_vnni(matrix.data, n, k))
        return PackedMatrix(FORMAT_Q8_0, n, k, _pack_q8_0(matrix.data, n, k))
    if int8 and matrix.qtype == QType.Q4_K:
        return PackedMatrix(FORMAT_Q4_K_VNNI, n, k, _pack_k_vnni(*_q4_k_blocks(matrix.data, n, k)))
    if int8 and matrix.qtype == QType.Q6_K:
        return PackedMatrix(FORMAT_Q6_K_VNNI, n, k, _pack_k_vnni(*_q6_k_blocks(matrix.data, n, k)))
    w = _pad_rows(matrix.dequantize(), NR)
    panels = w.reshape(-1, NR, k).transpose(0, 2, 1)
    return PackedMatrix(FORMAT_F32, n, k, np.ascontiguousarray(panels, dtype=np.float32))


def as_q8_0(matrix: WeightMatrix) -> WeightMatrix:
    """A Q5_0 matrix as the Q8_0 matrix with the same numbers (each block's f16 scale, and its codes
    q - 16 as int8); any other matrix as it is."""
    if matrix.qtype != QType.Q5_0:
        return matrix
    n, k = matrix.shape
    blocks = np.asarray(matrix.data, dtype=np.uint8).reshape(n, k // QK, 22)  # f16 d, u32 qh, 16 qs
    high = blocks[..., 2:6].copy().view("<u4") >> np.arange(QK, dtype=np.uint32)  # [N, B, 32]: bit j
    qs = blocks[..., 6:]
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # elements 0..15 low nibbles, 16..31 high
    codes = (low | ((high & 1).astype(np.uint8) << 4)).astype(np.int8) - np.int8(16)
    q8 = np.concatenate([blocks[..., 0:2], codes.view(np.uint8)], axis=-1).reshape(n, -1)
    return WeightMatrix(matrix.name, QType.Q8_0, matrix.shape, q8)


def _pad_rows(a: np.ndarray, multiple: int) -> np.ndarray:
    extra = -a.shape[0] % multiple
    return a if extra == 0 else np.concatenate([a, np.zeros((extra, *a.shape[1:]), a.dtype)])


def _panel_major(a: np.ndarray) -> np.ndarray:
    """[N, blocks, ...] → [panels, blocks, ..., 16]: the 16 rows of a panel become the last axis."""
    a = _pad_rows(a, NR)
    p = a.shape[0] // NR
    a = a.reshape(p, NR, *a.shape[1:])
    return np.moveaxis(a, 1, -1)


def _q4_1_panels(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_1 blocks in panel-major order: scales (d, m) [P, B, 2, 16] and codes [P, B, 32, 16] (element j of
    each block, unpacked from its nibble)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // QK, 20)
    scales = _panel_major(blocks[..., 0:4].copy().view(np.float16).reshape(n, k // QK, 2))
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [N, B, 32]
    return scales, _panel_major(codes)


def _pack_q4_1(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    scales, codes = _q4_1_panels(raw, n, k)
    pairs = codes[:, :, 0::2, :] | (codes[:, :, 1::2, :] << 4)  # [P, B, 16, 16]
    p, nb = pairs.shape[:2]
    out = np.concatenate(
        [np.ascontiguousarray(scales).view(np.uint8).reshape(p, nb, 64), pairs.reshape(p, nb, 256)], axis=-1
    )
    return np.ascontiguousarray(out)


def _pack_q8_0(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // QK, 34)
    scales = _panel_major(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // QK))  # [P, B, 16]
    codes = _panel_major(blocks[..., 2:])  # [P, B, 32, 16]
    p, nb = codes.shape[:2]
    out = np.concatenate(
        [np.ascontiguousarray(scales).view(np.uint8).reshape(p, nb, 32), codes.reshape(p, nb, 512)], axis=-1
    )
    return np.ascontiguousarray(out)


def _vnni_lanes(codes: np.ndarray) -> np.ndarray:
    """[P, B, 32, 16] codes (block element k, panel row n) → [P, B, 8, 64]: group g of 4 k, byte 4n + i
    = code (k = 4g + i, row n)."""
    p, nb = codes.shape[:2]
    return codes.reshape(p, nb, 8, 4, NR).transpose(0, 1, 2, 4, 3).reshape(p, nb, 8, 4 * NR)


def _pack_q4_1_vnni(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    scales, codes = _q4_1_panels(raw, n, k)
    groups = _vnni_lanes(codes)  # [P, B, 8, 64]
    nibbles = groups[:, :, :4] | (groups[:, :, 4:] << 4)  # k 0..15 low, k 16..31 high: [P, B, 4, 64]
    p, nb = nibbles.shape[:2]
    out = np.concatenate(
        [np.ascontiguousarray(scales).view(np.uint8).reshape(p, nb, 64), nibbles.reshape(p, nb, 256)], axis=-1
    )
    return np.ascontiguousarray(out)


def _pack_q8_0_vnni(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    blocks = np.asarray(raw, dtype=np.uint8).reshape(n, k // QK, 34)
    scales = _panel_major(blocks[..., 0:2].copy().view(np.float16).reshape(n, k // QK))  # [P, B, 16]
    codes = _vnni_lanes(_panel_major(blocks[..., 2:] ^ 0x80))  # int8 + 128 as uint8: [P, B, 8, 64]
    p, nb = codes.shape[:2]
    out = np.concatenate(
        [np.ascontiguousarray(scales).view(np.uint8).reshape(p, nb, 32), codes.reshape(p, nb, 512)], axis=-1
    )
    return np.ascontiguousarray(out)


def _q4_k_blocks(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Q4_K per 32-k block: d_lo, d_hi, m float32 [N, B] and codes uint8 [N, B, 32] (gguf's arithmetic:
    d = f16 d * 6-bit scale, m = f16 dmin * 6-bit min, weight d * q - m)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 144)  # f16 d, f16 dmin, 12 scale bytes, 128 qs
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])
    scale = (d * sc.astype(np.float32)).reshape(n, k // QK)
    minimum = (dmin * mins.astype(np.float32)).reshape(n, k // QK)
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (qs & np.uint8(0x0F)).reshape(n, k // QK, QK)  # sub-block 2c: low nibbles, 2c + 1: high
    return scale, scale, minimum, codes


def _q6_k_blocks(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Q6_K per 32-k block: d_lo, d_hi (its scales cover 16 weights), m = 0 float32 [N, B] and codes
    q uint8 [N, B, 32] (weight d * (q - 32), d = f16 d * int8 scale, as gguf computes)."""
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, 210)  # 128 ql, 64 qh, 16 int8 scales, f16 d
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    scale = (d * blocks[:, 192:208].copy().view(np.int8).astype(np.float32)).reshape(n, k // QK, 2)
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(
        1, 1, 4, 1
    )
    codes = (ql & np.uint8(0x0F)).reshape(-1, 8, 32) | ((qh & np.uint8(0x03)).reshape(-1, 8, 32) << 4)
    return scale[..., 0], scale[..., 1], np.zeros((n, k // QK), np.float32), codes.reshape(n, k // QK, QK)


def _pack_k_vnni(d_lo: np.ndarray, d_hi: np.ndarray, minimum: np.ndarray, codes: np.ndarray) -> np.ndarray:
    scales = _panel_major(np.stack([d_lo, d_hi, minimum], axis=-1).astype(np.float32))  # [P, B, 3, 16]
    lanes = _vnni_lanes(_panel_major(codes))  # [P, B, 8, 64]
    p, nb = lanes.shape[:2]
    out = np.concatenate(
        [np.ascontiguousarray(scales).view(np.uint8).reshape(p, nb, 192), lanes.reshape(p, nb, 512)], axis=-1
    )
    return np.ascontiguousarray(out)
