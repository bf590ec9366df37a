"""The null model runner: emits tokens at a set pace without computing anything.

For load-testing the mesh's own overhead (router, orchestrator, streams) with hundreds of concurrent
requests on a laptop. Everything else in the engine is real: scheduler, KV block accounting, prefix
cache, KV events, detokenization. Never the default backend; GetModelInfo says ``backend: null``.

Each step takes at least ``1 / tokens_per_s`` seconds, so every running stream gets about that many
tokens per second. The token at sequence position p is ``token_cycle[p % len(token_cycle)]`` (ordinary
text tokens, never end-of-sequence), so outputs are deterministic and run to max_tokens.

It tells the engine each row's argmax (``argmax``: the token it chose), as a GPU runner that picks on
the device would, so a greedy step does not scan the whole vocabulary of every row on the host; rows
sampled with a temperature still go through the host sampler over the full logits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from engine.model.runner import ModelSpec, SequenceChunk

# Logit of the chosen token; the rest are 0. High enough that any temperature <= 2 picks it.
_CHOSEN_LOGIT = 100.0


class NullModelRunner:
    backend = "null"
    tensor_parallel_size = 1

    def __init__(self, spec: ModelSpec, token_cycle: Sequence[int], tokens_per_s: float = 0.0) -> None:
        if not token_cycle:
            raise ValueError("the null runner needs at least one token to emit")
        self.spec = spec
        self._cycle = np.asarray(token_cycle, dtype=np.int64)
        self._step_s = 1.0 / tokens_per_s if tokens_per_s > 0 else 0.0
        self._next_step_at = 0.0
        # One logits buffer reused every step: only the chosen entries change.
        self._logits = np.zeros((0, spec.vocab_size), dtype=np.float32)
        self._chosen = np.zeros(0, dtype=np.int64)
        self._rows = 0  # rows of logits the last step returned

    def kv_bytes_per_block(self, block_size: int) -> int:
        return 0  # no KV tensors

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        """Logits valid until the next call (the buffer is reused)."""
        self._pace()
        # The position each row's token goes to: one per chunk needing logits, one more per draft token.
        ends: list[int] = []
        for c in chunks:
            if c.needs_logits:
                end = c.start_position + len(c.token_ids)
                ends += range(end - c.num_draft_tokens, end + 1)
        rows = len(ends)
        if rows > len(self._logits):
            self._logits = np.zeros((max(rows, 2 * len(self._logits)), self.spec.vocab_size), np.float32)
            self._chosen = np.zeros(len(self._logits), dtype=np.int64)
        index = np.arange(rows)
        self._logits[index, self._chosen[:rows]] = 0.0
        self._chosen[:rows] = self._cycle[np.asarray(ends, dtype=np.int64) % len(self._cycle)]
        self._logits[index, self._chosen[:rows]] = _CHOSEN_LOGIT
        self._rows = rows
        return self._logits[:rows]

    def argmax(self) -> np.ndarray:
        """Each row's argmax in the last ``execute``'s logits: the token it chose (the one nonzero)."""
        return self._chosen[: self._rows]

    def close(self) -> None:
        pass

    def _pace(self) -> None:
        if not self._step_s:
            return
        now = time.monotonic()
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)
        # A step that starts late does not earn a burst of catch-up steps.
        self._next_step_at = max(now, self._next_step_at) + self._step_s
