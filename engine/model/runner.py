"""The seam between the engine core (scheduler, KV block manager) and a model backend.

The core decides *which* tokens of *which* sequences to compute each step and *where* their KV lives
(block ids); a runner does the arithmetic. A runner owns the KV tensors, shaped per layer as
``[num_blocks, block_size, num_kv_heads, head_dim]`` (or its backend's equivalent), and never frees or
reuses blocks on its own. Backends (cpu, null, cuda, tensor-parallel) implement this protocol and
nothing else; the scheduler, the KV manager and KV events stay unaware of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class ModelSpec:
    """What the engine core needs to know about a model."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int


@dataclass
class SequenceChunk:
    """One sequence's share of a step: compute KV (and maybe logits) for ``token_ids``."""

    token_ids: (
        np.ndarray
    )  # int32 [n]: tokens whose KV this step computes (a prefill chunk, or 1 decode token)
    start_position: int  # position of token_ids[0] in the sequence; positions below it are already cached
    # Physical block ids covering positions [0, start_position + n): the request's own list, read only
    # while ``execute`` runs (no copy per chunk per step; a runner that keeps it copies it).
    block_table: Sequence[int]
    needs_logits: bool  # True when the chunk ends at the sequence's newest token (sample from it)
    # Speculation: the last num_draft_tokens of token_ids are draft tokens to verify. With needs_logits,
    # logits come back for the position before each of them too (num_draft_tokens + 1 rows, in order).
    num_draft_tokens: int = 0


class ModelRunner(Protocol):
    spec: ModelSpec
    backend: str  # "cpu", "null", "cuda", ...
    tensor_parallel_size: int

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Memory one KV block takes across all layers (and ranks), to size the pool."""
        ...

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Creates the KV tensors once, before the first step."""
        ...

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Runs one step over all chunks (one batched forward).

        Returns float32 logits, in chunk order: one row per chunk with needs_logits, and one more per
        draft token of such a chunk (its rows in position order).
        """
        ...

    def close(self) -> None:
        """Releases workers, shared memory and device memory."""
        ...

    # Optional: a runner that knows the argmax of each row of the logits its last ``execute`` returned
    # (ties: lowest id) without scanning them has a method ``argmax() -> np.ndarray``; greedy rows are
    # then picked from it. The null runner does (it put the chosen token there); a GPU runner could
    # take it on the device instead of a host scan of every row's whole vocabulary.
    #
    # Optional: a runner whose workers can die between steps (tensor parallelism) has an attribute
    # ``on_failure: Callable[[str], None] | None``; the engine sets it to ``LLMEngine.fail`` and the
    # runner calls it, from any thread, when it can no longer compute.
