"""A test-only model runner whose logits are a pure function of a sequence's tokens, as read back
through the KV blocks the engine gives it.

Its "KV cache" holds the token ids themselves, one slot per position. To produce logits it reads the
whole sequence back through the block table, so a prefix-cache hit on the wrong block, a block reused
while still referenced, or a preempted sequence recomputed into stale blocks changes the logits and
so the tokens. That lets core tests prove the bookkeeping equalities the real model must also satisfy
(prefix cache on/off, alone vs. batched, preempt-and-recompute) without real numerics. Not a model.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from engine.model.runner import ModelSpec, SequenceChunk


class TokenFunctionRunner:
    backend = "test"
    tensor_parallel_size = 1

    def __init__(self, vocab_size: int, candidates: Sequence[int], context_length: int = 4096) -> None:
        self.spec = ModelSpec("token-function", 1, 1, 1, vocab_size, context_length)
        self.candidates = np.asarray(sorted(set(candidates)), dtype=np.int64)
        self.kv = np.zeros((0, 1), dtype=np.int64)
        self.block_size = 1
        self.batches: list[list[tuple[int, int]]] = []  # per execute: (start_position, tokens) per chunk
        self.fail_with: Exception | None = None

    def kv_bytes_per_block(self, block_size: int) -> int:
        return block_size * 8

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.kv = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.block_size = block_size

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        if self.fail_with is not None:
            raise self.fail_with
        self.batches.append([(c.start_position, len(c.token_ids)) for c in chunks])
        rows = []
        for chunk in chunks:
            end = chunk.start_position + len(chunk.token_ids)
            if len(chunk.token_ids) == 0:
                raise RuntimeError("an empty chunk: a real model has no hidden state to take logits from")
            if len(chunk.block_table) * self.block_size < end:
                raise RuntimeError(f"block table of {len(chunk.block_table)} blocks cannot hold {end} tokens")
            positions = np.arange(chunk.start_position, end)
            table = np.asarray(chunk.block_table)
            blocks, offsets = table[positions // self.block_size], positions % self.block_size
            self.kv[blocks, offsets] = chunk.token_ids
            if chunk.needs_logits:
                everything = np.arange(end)
                seen = self.kv[table[everything // self.block_size], everything % self.block_size]
                if (seen < 0).any():
                    raise RuntimeError("read a KV slot that was never written")
                # A chunk with draft tokens: logits after each of its last 1 + num_draft_tokens tokens.
                rows += [self.logits_for(seen[:e]) for e in range(end - chunk.num_draft_tokens, end + 1)]
        return np.stack(rows) if rows else np.zeros((0, self.spec.vocab_size), np.float32)

    def logits_for(self, tokens: Sequence[int]) -> np.ndarray:
        """The logits after ``tokens``: only candidate tokens are likely, in a token-dependent order."""
        digest = hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng(int.from_bytes(digest, "little"))
        logits = np.full(self.spec.vocab_size, -30.0, dtype=np.float32)
        logits[self.candidates] = 3.0 * rng.standard_normal(len(self.candidates)).astype(np.float32)
        return logits

    def greedy_reference(self, prompt: Sequence[int], max_tokens: int, stop_ids: frozenset[int]) -> list[int]:
        """Greedy decoding without any cache: logits of the full token list at every step."""
        tokens, out = list(prompt), []
        while len(out) < max_tokens:
            token = int(np.argmax(self.logits_for(tokens)))
            out.append(token)
            tokens.append(token)
            if token in stop_ids:
                break
        return out

    def close(self) -> None:
        pass
