"""What one simulated engine step costs, and how much KV cache and queue an engine has.

A step of our engine's continuous-batching scheduler runs every running request's next decode token and
up to a token budget of prefill, in one forward pass. Its time is modelled as a line fitted to our CPU
engine's measurements (docs/benchmarks/engine.md, 2-core Xeon, SmolLM2-135M Q4_1)::

    step_ms = fixed + per_sequence · decoding + per_prefill_token · prefill_tokens
              + per_context_token · (context tokens the decoding requests attend over)

- decode, 1 stream: 81 tok/s → 12.3 ms a step; 32 streams: 406 tok/s → 78.8 ms a step
  ⇒ per_sequence = (78.8 - 12.3) / 31 = 2.15 ms, fixed = 10.2 ms;
- prefill of one 256-token prompt at 548 tok/s: 467 ms ⇒ per_prefill_token = (467 - 10.2) / 256 = 1.78 ms;
- 32 streams at 1k-token contexts: 308 ms a step against 78.8 ms at ~96 tokens
  ⇒ per_context_token = (308 - 78.8) / (32 · 904) = 7.9 µs.

KV capacity: the engine's default pool is 0.5 GiB of float32 K and V for 30 layers x 3 KV heads x 64
dims = 46,080 bytes a token, so 11,650 tokens = 728 blocks of 16.

``SEEDS_GPU`` is an assumption, not a measurement: no GPU engine of ours has run (docs/gpu.md). Our CPU
engine's shape cannot stand for it: on a CPU every decoding sequence costs real compute (2.15 ms plus its
attention), so a batch barely amortizes and 120 streams an engine would need 120 x our step rate. A GPU's
batched decode is memory-bound instead: a step reads the weights once (the fixed term) and each
sequence's KV (the per-context-token term). The values are chosen so that 1,000 such engines carry the
seeds' peak, 20 prompts/s and ~120 streams each, with ~4k-token contexts: 6.5 ms a step,
25 µs a sequence, 20 ns a context token (about an 8B model's fp8 KV read at H100 bandwidth), 15 µs a
prefill token (~65k tokens/s), 40,000 blocks of 64 tokens (2.56M tokens of KV), a waiting queue of 24
(about a second of arrivals: the bound admission derives its thresholds from). The simulation's
placement figures (µs per decision, index memory, event rates) do not depend on these; its TTFT and
shed figures do.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCosts:
    fixed_ms: float = 10.2
    per_sequence_ms: float = 2.15
    per_prefill_token_ms: float = 1.78
    per_context_token_ms: float = 0.0079
    kv_blocks: int = 728
    block_size: int = 16
    max_running_requests: int = 64  # the engine's defaults (engine/config.py)
    max_batched_tokens: int = 512
    max_waiting_requests: int = 256

    def step_s(self, decoding: int, prefill_tokens: int, context_tokens: int) -> float:
        ms = (
            self.fixed_ms
            + self.per_sequence_ms * decoding
            + self.per_prefill_token_ms * prefill_tokens
            + self.per_context_token_ms * context_tokens
        )
        return ms / 1000.0


SMOLLM2_CPU = EngineCosts()

# 64-token blocks (llm-d's size) keep the router's index a quarter of what 16-token blocks would need.
SEEDS_GPU = EngineCosts(
    fixed_ms=6.5,
    per_sequence_ms=0.025,
    per_prefill_token_ms=0.015,
    per_context_token_ms=0.00002,
    kv_blocks=40_000,
    block_size=64,
    max_running_requests=256,
    max_batched_tokens=8192,
    # A queue drains at ~20 prompts/s: 24 waiting is ~1 s, so the free tier (shed at half the bound) is
    # refused before its wait alone breaks the 500 ms TTFT target. The engine's default, 256, is ~13 s.
    max_waiting_requests=24,
)
