"""Prompt-lookup speculative decoding in the engine core: the output is token for token the output
without speculation (greedy and seeded, alone and batched, with the prefix cache, across a preemption,
with stops and logprobs), rejected drafts' KV is never cached or published, and the gates hold.

On the token-function runner, whose logits are a pure function of the tokens read back through the KV
blocks: a draft whose rejected KV counted as computed, or a block cached with it, changes the tokens.
``QuotingRunner`` makes its model quote its context (as chat answers do), so drafts are often accepted,
and not always."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from chatmesh.block_hash import block_hashes
from engine.kv_events import BlocksStored
from engine.model.runner import ModelSpec, SequenceChunk
from engine.model.step_batch import build_step_batch
from engine.request import EngineRequest
from engine.speculation import PROBE_STEPS, Drafter, NgramIndex
from tests.engine.core_helpers import (
    DrivenEngine,
    Result,
    make_engine,
    prompt,
    request,
    tokenizer,
    word_tokens,
)
from tests.engine.token_function_runner import TokenFunctionRunner

SPECULATING = {"speculative_tokens": 4, "speculative_max_batch": 8}


class QuotingRunner(TokenFunctionRunner):
    """A model that mostly continues with what followed the latest earlier occurrence of its newest
    token, and at every seventh position (or with nothing to quote) picks its own token-function one. Records the draft tokens of each step's chunks."""

    def __init__(self) -> None:
        super().__init__(tokenizer().vocab_size, word_tokens())
        self.drafts: list[list[int]] = []

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        self.drafts.append([c.num_draft_tokens for c in chunks])
        return super().execute(chunks)

    def logits_for(self, tokens: Sequence[int]) -> np.ndarray:
        logits = super().logits_for(tokens)
        tokens = np.asarray(tokens)
        earlier = np.flatnonzero(tokens[:-1] == tokens[-1])
        if len(earlier) and len(tokens) % 7:
            logits[tokens[earlier[-1] + 1]] += 12.0
        return logits


def quoting_prompt(n: int, salt: int = 0) -> list[int]:
    """A prompt that repeats itself with small edits: something to quote from."""
    base = prompt(n // 2, salt)
    return base + [t if i % 9 else word_tokens()[(i + salt) % 5] for i, t in enumerate(base)]


def run(requests: Sequence[EngineRequest], **config: object) -> tuple[dict[str, Result], DrivenEngine]:
    test = make_engine(QuotingRunner(), **config)
    for req in requests:
        test.engine.add_request(req)
    return test.run(), test


def assert_same_as_without(requests: Sequence[EngineRequest], **config: object) -> DrivenEngine:
    """Runs ``requests`` together with speculation and each alone without: identical results (tokens,
    text, finish, logprobs). Returns the speculating run, which must have accepted and rejected drafts."""
    spec, test = run(requests, **{**SPECULATING, **config})
    for req in requests:
        plain = run([req], **config)[0][req.request_id]
        got = spec[req.request_id]
        assert got.token_ids == plain.token_ids, req.request_id
        assert (got.text, got.finish.reason, got.finish.matched_stop) == (
            plain.text,
            plain.finish.reason,
            plain.finish.matched_stop,
        )
    engine = test.engine
    assert 0 < engine.accepted_draft_tokens < engine.draft_tokens, "drafts accepted and rejected"
    return test


# -- the proposer -------------------------------------------------------------------------------------


def test_the_index_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3]
    # The 3-gram (1, 2, 3) occurred first, followed by 4, 5, 9 (the 2-gram (2, 3) later, by 7, 8).
    assert index.propose(tokens, 3) == [4, 5, 9]
    # (6, 2, 3) never occurred: the latest (2, 3) did, at the end of the tokens above, followed by 4, 6.
    assert index.propose([*tokens, 4, 6, 6, 2, 3], 2) == [4, 6], "no 3-gram match: the latest 2-gram"
    assert NgramIndex().propose([5, 6, 7, 8], 4) == [], "nothing repeats"
    assert NgramIndex().propose([5, 6, 5, 6], 4) == [5, 6], "no further than the sequence goes"


def test_a_request_drafts_as_far_as_its_acceptance_pays_and_stops_but_for_probes_when_rejected():
    drafter, tokens = Drafter(), [1, 2, 3, 1, 2]
    assert drafter.draft(tokens, 4) == [3, 1], "a new request drafts 2"
    for _ in range(4):
        drafter.verified(2, 2)
    assert drafter.draft(tokens, 4) == [3, 1, 2], "accepted: as far as the sequence goes"
    while drafter.worth_drafting():
        drafter.verified(3, 0)
    drafted = [drafter.draft(tokens, 4) for _ in range(2 * PROBE_STEPS)]
    assert [i for i, d in enumerate(drafted) if d] == [PROBE_STEPS - 1, 2 * PROBE_STEPS - 1]
    assert drafted[PROBE_STEPS - 1] == [3], "a probe of one token"


def test_a_verifying_chunk_returns_logits_at_its_newest_token_and_each_draft():
    chunks = [
        SequenceChunk(np.array([5], np.int32), 7, [0, 1], True),
        SequenceChunk(np.array([5, 6, 7, 8], np.int32), 3, [2, 3], True, num_draft_tokens=3),
        SequenceChunk(np.array([1, 2], np.int32), 0, [4], False),
    ]
    assert build_step_batch(chunks, 4, 64).logit_rows.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="draft tokens"):
        build_step_batch([SequenceChunk(np.array([5], np.int32), 0, [0], True, num_draft_tokens=1)], 4, 64)


# -- the engine ---------------------------------------------------------------------------------------


def test_greedy_output_is_the_same_with_and_without_speculation_alone_and_batched():
    quoting = [request(f"q{i}", quoting_prompt(40, salt=i), max_tokens=40) for i in range(3)]
    plain = [request(f"p{i}", prompt(12, salt=10 + i), max_tokens=20) for i in range(2)]
    for req in quoting:
        assert_same_as_without([req])
    assert_same_as_without([*quoting, *plain])


def test_seeded_sampling_and_logprobs_are_the_same_with_and_without_speculation():
    reqs = [
        request(
            f"s{i}",
            quoting_prompt(40, salt=i),
            max_tokens=40,
            temperature=0.8,
            top_p=0.95,
            seed=7 + i,
            logprobs=True,
            top_logprobs=2,
            presence_penalty=0.1 * i,
        )
        for i in range(2)
    ]
    test = assert_same_as_without(reqs)
    spec = {o.request_id: [] for o in test.outputs}
    for o in test.outputs:
        spec[o.request_id] += o.logprobs
    for req in reqs:
        alone = run([req])[1].outputs
        assert spec[req.request_id] == [lp for o in alone for lp in o.logprobs], "logprobs identical"


def test_a_step_with_more_running_requests_than_the_gate_drafts_nothing():
    reqs = [request(f"q{i}", quoting_prompt(40, salt=i), max_tokens=24 + 8 * i) for i in range(3)]
    _, test = run(reqs, speculative_tokens=4, speculative_max_batch=2)
    steps = test.runner.drafts  # type: ignore[attr-defined]
    assert any(sum(step) for step in steps), "the last two requests speculate"
    assert all(not sum(step) for step in steps if len(step) > 2)


def test_stops_and_max_tokens_inside_an_accepted_run_end_the_output_as_without_speculation():
    base = quoting_prompt(40, salt=3)
    whole = run([request("w", base, max_tokens=40)], **SPECULATING)[0]["w"]
    words = [t for t in whole.token_ids[10:] if t in base]
    stop_text = whole.text[len(whole.text) // 2 :][:6]
    assert_same_as_without(
        [
            request("text", base, max_tokens=40, stop=(stop_text,)),
            request("token", base, max_tokens=40, stop_token_ids=frozenset(words[:1])),
            request("length", base, max_tokens=23),
        ]
    )


def test_prefix_cache_hits_and_published_blocks_hold_only_accepted_tokens():
    base = quoting_prompt(48, salt=5)
    test = make_engine(QuotingRunner(), **SPECULATING)
    engine = test.engine
    snapshot, subscription = engine.events.subscribe(lambda: None)
    engine.add_request(request("first", base, max_tokens=40))
    first = test.run()["first"]
    engine.add_request(request("again", base, max_tokens=40))  # its prompt's blocks come from the cache
    again = test.run()["again"]
    assert engine.stats.prefix_hit_tokens > 0
    assert again.token_ids == first.token_ids
    assert 0 < engine.accepted_draft_tokens < engine.draft_tokens, "drafts accepted and rejected"
    stored = {
        block_hash
        for batch in subscription.take()
        for event in batch.events
        if isinstance(event, BlocksStored)
        for block_hash in event.block_hashes
    }
    # Every block ever cached hashes tokens the requests really have (prompt + output), never a draft.
    truth = base + first.token_ids
    chain = set(block_hashes(truth[: len(truth) // 4 * 4], 4, engine.kv.hash_seed))
    assert snapshot.block_hashes == frozenset()
    assert stored and stored <= chain
    assert engine.kv.pool.cached_hashes() <= chain


def test_a_preempted_speculating_request_continues_as_without_speculation():
    reqs = [request(f"q{i}", quoting_prompt(40, salt=i), max_tokens=48) for i in range(3)]
    test = assert_same_as_without(reqs, num_kv_blocks=48)
    assert test.engine.stats.preemptions > 0


def test_the_null_runner_answers_every_verified_position():
    from engine.model.null_runner import NullModelRunner

    runner = NullModelRunner(ModelSpec("null", 1, 1, 1, 50, 64), [10, 11, 12, 13])
    logits = runner.execute(
        [SequenceChunk(np.array([1, 2, 3], np.int32), 4, [0, 1], True, num_draft_tokens=2)]
    )
    assert runner.argmax().tolist() == np.argmax(logits, axis=1).tolist() == [11, 12, 13]


def test_a_resumed_request_speculates_on_and_continues_as_the_uninterrupted_one():
    """Failover: output an earlier engine delivered is context here, and drafts can quote it too."""
    base = quoting_prompt(40, salt=2)
    whole = run([request("whole", base, max_tokens=40)])[0]["whole"]
    resumed = request("again", base, max_tokens=40, resumed=tuple(whole.token_ids[:12]))
    test = assert_same_as_without([resumed])
    assert test.run()["again"].token_ids == whole.token_ids[12:]
