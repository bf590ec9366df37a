"""A minimal greedy driver over a runner's paged KV cache, for the runner tests.

It allocates blocks from a free list (optionally shuffled, so sequences get scattered, non-contiguous
blocks), feeds prompts in chunks and decodes every running sequence together each step. It is *not* the
engine's scheduler: no token budget, prefix sharing, preemption or priorities — only enough to drive a
``ModelRunner`` exactly as the engine core does through ``SequenceChunk``s.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from engine.model.runner import ModelRunner, SequenceChunk


@dataclass
class GreedyRun:
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far
    logits: list[np.ndarray] = field(default_factory=list)  # the logits each generated token came from
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # positions whose KV is in the cache
    done: bool = False


class PagedDriver:
    def __init__(
        self, runner: ModelRunner, num_blocks: int, block_size: int = 16, shuffle_seed: int | None = None
    ) -> None:
        self.runner = runner
        self.block_size = block_size
        runner.allocate_kv_cache(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free_blocks)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        prefill_chunk: int | None = None,
        stop_ids: Sequence[int] = (),
        keep_logits: bool = False,
    ) -> list[GreedyRun]:
        """Greedy-decodes all prompts together; prompts are fed ``prefill_chunk`` tokens per step."""
        gens = [GreedyRun(list(p), max_new_tokens) for p in prompts]
        while not all(g.done for g in gens):
            running = [g for g in gens if not g.done]
            chunks = [self._next_chunk(g, prefill_chunk) for g in running]
            logits = self.runner.execute(chunks)
            sampled = iter(logits)
            for gen, chunk in zip(running, chunks, strict=True):
                gen.computed += len(chunk.token_ids)
                if not chunk.needs_logits:
                    continue
                row = next(sampled)
                gen.tokens.append(int(np.argmax(row)))
                if keep_logits:
                    gen.logits.append(row.copy())
                if gen.tokens[-1] in stop_ids or len(gen.tokens) >= gen.max_new_tokens:
                    self.release(gen)
        return gens

    def release(self, gen: GreedyRun) -> None:
        gen.done = True
        self.free_blocks.extend(gen.blocks)
        gen.blocks = []

    def _next_chunk(self, gen: GreedyRun, prefill_chunk: int | None) -> SequenceChunk:
        known = gen.prompt + gen.tokens
        end = len(known) if prefill_chunk is None else min(len(known), gen.computed + prefill_chunk)
        while len(gen.blocks) * self.block_size < end:
            if not self.free_blocks:
                raise RuntimeError("out of KV blocks: give the driver more")
            gen.blocks.append(self.free_blocks.pop())
        return SequenceChunk(
            token_ids=np.asarray(known[gen.computed : end], dtype=np.int32),
            start_position=gen.computed,
            block_table=np.asarray(gen.blocks, dtype=np.int32),
            needs_logits=end == len(known),
        )
