"""The tensor-parallel sharding plan: which heads, FFN columns and vocabulary rows each rank owns.

Megatron-style, one all-reduce after each row-parallel matmul:

- attention: rank r owns a contiguous range of KV heads and the query heads that attend to them (a GQA
  group never straddles ranks, so attention needs no communication). Its QKV rows are column-parallel,
  its slice of the attention-output matrix's *input* columns row-parallel, its KV cache only its KV heads;
- FFN: gate and up rows column-parallel, the down projection's input columns row-parallel;
- LM head: vocab-parallel (rows of the vocabulary), logits gathered at rank 0.

When the ranks do not divide the KV heads (SmolLM2: 3 KV heads over 2 ranks) the heads are split as
evenly as whole heads allow (2 + 1), and the FFN columns are shifted towards the ranks with fewer heads so
every rank holds about the same weight bytes per layer: a decode step is bound by reading weights, and
the all-reduce makes each layer as slow as its slowest rank. Replicating KV heads instead would keep
attention even but duplicate K/V projections and KV-cache memory on every rank.

Row-parallel splits cut the matrices' *input* dimension, so every cut must fall on a quantization block
(32 weights for the GGUF formats we pack); the plan only cuts on multiples of ``quant_block``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model.checkpoint import LlamaConfig


@dataclass(frozen=True)
class Span:
    """Half-open ``[start, stop)``."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def as_slice(self) -> slice:
        return slice(self.start, self.stop)


@dataclass(frozen=True)
class RankShard:
    rank: int
    kv_heads: Span
    q_heads: Span  # the query heads of kv_heads' GQA groups
    ffn_columns: Span  # of the intermediate dimension
    vocab: Span  # LM-head rows

    def local_config(self, config: LlamaConfig) -> LlamaConfig:
        """The model as this rank's attention kernels see it: its own heads only."""
        return replace(
            config,
            num_heads=self.q_heads.size,
            num_kv_heads=self.kv_heads.size,
            intermediate_size=self.ffn_columns.size,
        )


@dataclass(frozen=True)
class TpPlan:
    world_size: int
    shards: tuple[RankShard, ...]


class PlanError(ValueError):
    """The model cannot be split over that many ranks."""


def plan_tensor_parallel(config: LlamaConfig, world_size: int, quant_block: int = 32) -> TpPlan:
    if world_size < 1:
        raise PlanError(f"tensor parallel size must be >= 1, got {world_size}")
    if config.num_heads % config.num_kv_heads:
        raise PlanError(
            f"{config.num_heads} query heads do not form groups over {config.num_kv_heads} KV heads"
        )
    if world_size > config.num_kv_heads:
        raise PlanError(
            f"tensor parallel size {world_size} exceeds the model's {config.num_kv_heads} KV heads "
            "(a rank needs at least one KV head; replicating KV heads is not implemented)"
        )
    group_width = config.head_dim * (config.num_heads // config.num_kv_heads)
    if world_size > 1 and (group_width % quant_block or config.intermediate_size % quant_block):
        raise PlanError(
            f"head groups of {config.num_heads // config.num_kv_heads}x{config.head_dim} and an FFN of "
            f"{config.intermediate_size} do not split on {quant_block}-weight quantization blocks"
        )
    group = config.num_heads // config.num_kv_heads
    kv_spans = even_spans(config.num_kv_heads, world_size, 1)
    ffn_align = quant_block if world_size > 1 else config.intermediate_size
    ffn_spans = _balanced_ffn_spans(config, [s.size for s in kv_spans], ffn_align)
    vocab_spans = even_spans(config.vocab_size, world_size, 1)
    shards = tuple(
        RankShard(
            rank=r,
            kv_heads=kv,
            q_heads=Span(kv.start * group, kv.stop * group),
            ffn_columns=ffn,
            vocab=vocab,
        )
        for r, (kv, ffn, vocab) in enumerate(zip(kv_spans, ffn_spans, vocab_spans, strict=True))
    )
    return TpPlan(world_size, shards)


def even_spans(total: int, parts: int, align: int) -> list[Span]:
    """``total`` split into ``parts`` contiguous spans, sizes multiples of ``align`` differing by at most
    one ``align`` unit (earlier spans take the extra units). ``total`` must be a multiple of ``align``."""
    units, extra = divmod(total // align, parts)
    if units == 0:
        raise PlanError(f"{total} cannot be split {parts} ways in units of {align}")
    sizes = [(units + (r < extra)) * align for r in range(parts)]
    return _spans(sizes)


def _balanced_ffn_spans(config: LlamaConfig, kv_heads: list[int], align: int) -> list[Span]:
    """FFN columns per rank such that attention + FFN weights per rank are as even as ``align`` allows,
    every rank keeping at least one ``align`` unit."""
    per_column = _ffn_elements(config, 1)
    total = sum(_attention_elements(config, h) for h in kv_heads) + _ffn_elements(
        config, config.intermediate_size
    )
    target = total / len(kv_heads)
    units_left = config.intermediate_size // align
    sizes = []
    for r, heads in enumerate(kv_heads):
        ranks_after = len(kv_heads) - r - 1
        if ranks_after == 0:
            units = units_left
        else:
            wanted = round((target - _attention_elements(config, heads)) / per_column / align)
            units = min(max(wanted, 1), units_left - ranks_after)
        sizes.append(units * align)
        units_left -= units
    return _spans(sizes)


def _spans(sizes: list[int]) -> list[Span]:
    spans, start = [], 0
    for size in sizes:
        spans.append(Span(start, start + size))
        start += size
    return spans


def _attention_elements(config: LlamaConfig, kv_heads: int) -> int:
    """Q, K, V rows and attention-output columns of ``kv_heads`` KV heads and their query groups."""
    q_width = kv_heads * (config.num_heads // config.num_kv_heads) * config.head_dim
    kv_width = kv_heads * config.head_dim
    return (2 * q_width + 2 * kv_width) * config.hidden_size


def _ffn_elements(config: LlamaConfig, columns: int) -> int:
    return 3 * columns * config.hidden_size
