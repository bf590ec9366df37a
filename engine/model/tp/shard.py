"""Slices of stored weight matrices, as one rank of a tensor-parallel plan holds them.

Column-parallel matrices are cut along their output rows (any row boundary works, quantized or not);
row-parallel matrices along their input columns, which in a quantized matrix must fall on a quantization
block: a block's scale covers all of its weights.
"""

from __future__ import annotations

import gguf

from engine.model.checkpoint import WeightMatrix
from engine.model.tp.plan import Span


def take_rows(matrix: WeightMatrix, rows: Span) -> WeightMatrix:
    if rows.start == 0 and rows.stop == matrix.shape[0]:
        return matrix
    return WeightMatrix(
        f"{matrix.name}[{rows.start}:{rows.stop}]",
        matrix.qtype,
        (rows.size, matrix.shape[1]),
        matrix.data[rows.as_slice()],
    )


def take_columns(matrix: WeightMatrix, columns: Span) -> WeightMatrix:
    if columns.start == 0 and columns.stop == matrix.shape[1]:
        return matrix
    block, block_bytes = gguf.GGML_QUANT_SIZES[matrix.qtype]
    if columns.start % block or columns.stop % block:
        raise ValueError(
            f"{matrix.name}: columns {columns.start}:{columns.stop} cut through {block}-weight "
            f"{matrix.qtype.name} blocks"
        )
    if matrix.qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = matrix.data[:, columns.as_slice()]
    else:
        data = matrix.data[:, columns.start // block * block_bytes : columns.stop // block * block_bytes]
    return WeightMatrix(
        f"{matrix.name}[:, {columns.start}:{columns.stop}]",
        matrix.qtype,
        (matrix.shape[0], columns.size),
        data,
    )
