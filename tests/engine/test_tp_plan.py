"""The tensor-parallel sharding plan (pure): coverage, GQA groups, quantization-block cuts, balance."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from engine.model.checkpoint import LlamaConfig
from engine.model.tp.plan import (
    PlanError,
    Span,
    _attention_elements,
    _ffn_elements,
    even_spans,
    plan_tensor_parallel,
)

SMOLLM2_135M = LlamaConfig(
    name="smollm2-135m",
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    context_length=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
)
# A LLaMA-3-8B-shaped model: 32 query heads over 8 KV heads, splits evenly over 2, 4 and 8 ranks.
LLAMA_8B = replace(
    SMOLLM2_135M,
    hidden_size=4096,
    intermediate_size=14336,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab_size=128256,
)


def assert_covers(spans: list[Span], total: int) -> None:
    assert spans[0].start == 0 and spans[-1].stop == total
    for left, right in itertools.pairwise(spans):
        assert left.stop == right.start and left.size > 0


@pytest.mark.parametrize(
    ("config", "world"),
    [(SMOLLM2_135M, 1), (SMOLLM2_135M, 2), (SMOLLM2_135M, 3), (LLAMA_8B, 2), (LLAMA_8B, 4), (LLAMA_8B, 8)],
)
def test_every_head_column_and_vocab_row_belongs_to_exactly_one_rank(config: LlamaConfig, world: int):
    plan = plan_tensor_parallel(config, world)
    shards = plan.shards
    assert [s.rank for s in shards] == list(range(world))
    assert_covers([s.kv_heads for s in shards], config.num_kv_heads)
    assert_covers([s.q_heads for s in shards], config.num_heads)
    assert_covers([s.ffn_columns for s in shards], config.intermediate_size)
    assert_covers([s.vocab for s in shards], config.vocab_size)


@pytest.mark.parametrize("world", [2, 3])
def test_query_heads_stay_with_the_kv_head_they_attend_to(world: int):
    group = SMOLLM2_135M.num_heads // SMOLLM2_135M.num_kv_heads
    for shard in plan_tensor_parallel(SMOLLM2_135M, world).shards:
        assert shard.q_heads == Span(shard.kv_heads.start * group, shard.kv_heads.stop * group)
        local = shard.local_config(SMOLLM2_135M)
        assert local.num_heads // local.num_kv_heads == group


def test_three_kv_heads_over_two_ranks_split_two_and_one_with_ffn_rebalanced():
    first, second = plan_tensor_parallel(SMOLLM2_135M, 2).shards
    assert (first.kv_heads.size, second.kv_heads.size) == (2, 1)
    # The rank with fewer heads takes more FFN columns, so both hold about the same weights per layer.
    assert first.ffn_columns.size < second.ffn_columns.size
    a, b = (
        _attention_elements(SMOLLM2_135M, s.kv_heads.size) + _ffn_elements(SMOLLM2_135M, s.ffn_columns.size)
        for s in (first, second)
    )
    assert abs(a - b) / max(a, b) < 0.03
    assert first.vocab.size == second.vocab.size == SMOLLM2_135M.vocab_size // 2


def test_even_splits_stay_even():
    shards = plan_tensor_parallel(LLAMA_8B, 4).shards
    assert {s.kv_heads.size for s in shards} == {2}
    assert {s.ffn_columns.size for s in shards} == {LLAMA_8B.intermediate_size // 4}


@pytest.mark.parametrize(("config", "world"), [(SMOLLM2_135M, 2), (SMOLLM2_135M, 3), (LLAMA_8B, 8)])
def test_row_parallel_cuts_fall_on_quantization_blocks(config: LlamaConfig, world: int):
    for shard in plan_tensor_parallel(config, world).shards:
        q_columns = (shard.q_heads.start * config.head_dim, shard.q_heads.stop * config.head_dim)
        for cut in (*q_columns, shard.ffn_columns.start, shard.ffn_columns.stop):
            assert cut % 32 == 0


def test_one_rank_holds_the_whole_model_whatever_its_shapes():
    odd = replace(SMOLLM2_135M, intermediate_size=1000)
    (shard,) = plan_tensor_parallel(odd, 1).shards
    assert shard.ffn_columns == Span(0, 1000) and shard.kv_heads == Span(0, 3)


@pytest.mark.parametrize(
    ("config", "world", "message"),
    [
        (SMOLLM2_135M, 4, "exceeds the model's 3 KV heads"),
        (SMOLLM2_135M, 0, "must be >= 1"),
        (replace(SMOLLM2_135M, intermediate_size=1000), 2, "quantization blocks"),
        (replace(SMOLLM2_135M, num_heads=8), 2, "do not form groups"),
    ],
)
def test_impossible_splits_are_refused_with_the_reason(config: LlamaConfig, world: int, message: str):
    with pytest.raises(PlanError, match=message):
        plan_tensor_parallel(config, world)


def test_even_spans_give_earlier_parts_the_remainder_in_aligned_units():
    assert even_spans(96, 2, 32) == [Span(0, 64), Span(64, 96)]
    assert even_spans(3, 2, 1) == [Span(0, 2), Span(2, 3)]
    with pytest.raises(PlanError):
        even_spans(32, 2, 32)
