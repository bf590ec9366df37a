"""One step's chunks flattened into the index arrays a runner's kernels need."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from engine.model.runner import SequenceChunk


@dataclass(frozen=True)
class StepBatch:
    token_ids: np.ndarray  # int32 [T]: all chunks' tokens, chunk after chunk
    positions: np.ndarray  # int32 [T]: each token's position in its sequence
    slots: np.ndarray  # int64 [T]: where each token's K/V goes: block_id * block_size + offset
    token_seq: np.ndarray  # int32 [T]: the chunk each token belongs to (row of block_tables)
    chunk_starts: np.ndarray  # int64 [chunks + 1]: chunk c is rows chunk_starts[c]:chunk_starts[c+1]
    block_tables: np.ndarray  # int32 [chunks, max_blocks], padded with 0
    max_len: int  # longest attention span (positions 0..pos) in the step
    logit_rows: np.ndarray  # int64: rows whose next-token logits are returned, in chunk order (a chunk
    # with draft tokens: the rows of its last 1 + num_draft_tokens positions)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def build_step_batch(chunks: Sequence[SequenceChunk], block_size: int, context_length: int) -> StepBatch:
    if not chunks:
        raise ValueError("a step needs at least one chunk")
    lengths = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    if (lengths == 0).any():
        raise ValueError("a chunk must carry at least one token")
    if any(not 0 <= c.num_draft_tokens < len(c.token_ids) for c in chunks):
        raise ValueError("a chunk's draft tokens must follow at least one token of its own")
    chunk_starts = np.concatenate([[0], np.cumsum(lengths)])
    total = int(chunk_starts[-1])
    starts = np.array([c.start_position for c in chunks], dtype=np.int64)
    ends = starts + lengths
    if (starts < 0).any() or ends.max() > context_length:
        raise ValueError(f"positions must lie in [0, {context_length})")
    max_blocks = max(len(c.block_table) for c in chunks)
    block_tables = np.zeros((len(chunks), max_blocks), dtype=np.int32)
    for i, chunk in enumerate(chunks):
        if len(chunk.block_table) * block_size < ends[i]:
            raise ValueError(
                f"chunk {i}: block table covers {len(chunk.block_table) * block_size} positions, needs {ends[i]}"
            )
        block_tables[i, : len(chunk.block_table)] = chunk.block_table

    token_seq = np.repeat(np.arange(len(chunks), dtype=np.int32), lengths)
    positions = np.arange(total, dtype=np.int64) - np.repeat(chunk_starts[:-1] - starts, lengths)
    slots = (
        block_tables[token_seq, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )
    num_logits = np.array([1 + c.num_draft_tokens if c.needs_logits else 0 for c in chunks], dtype=np.int64)
    # Each row's distance back from its chunk's last position: ..., 2, 1, 0 over a chunk's rows.
    back = np.repeat(np.cumsum(num_logits), num_logits) - np.arange(num_logits.sum()) - 1
    return StepBatch(
        token_ids=np.concatenate([np.asarray(c.token_ids, dtype=np.int32) for c in chunks]),
        positions=positions.astype(np.int32),
        slots=slots,
        token_seq=token_seq,
        chunk_starts=chunk_starts,
        block_tables=block_tables,
        max_len=int(ends.max()),
        logit_rows=np.repeat(chunk_starts[1:] - 1, num_logits) - back,
    )
