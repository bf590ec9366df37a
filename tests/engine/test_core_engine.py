"""The engine core end to end on the token-function runner: bookkeeping that real numerics rely on."""

import grpc
import pytest

from chatmesh.finish import FinishReason
from engine.kv_events import apply_events
from engine.request import Priority
from engine.request_tracker import DuplicateRequestError, EngineUnavailableError, QueueFullError
from tests.engine.core_helpers import (
    DrivenEngine,
    make_engine,
    prompt,
    request,
    results,
    tokenizer,
    word_tokens,
)
from tests.engine.token_function_runner import TokenFunctionRunner


def eos() -> frozenset[int]:
    return frozenset(tokenizer().eos_token_ids)


def test_greedy_tokens_equal_a_reference_without_cache():
    test = make_engine()
    prompts = {f"r{i}": prompt(5 + 9 * i, salt=i) for i in range(5)}
    for rid, ids in prompts.items():
        test.engine.add_request(request(rid, ids, max_tokens=12))
    done = test.run()
    for rid, ids in prompts.items():
        assert done[rid].token_ids == test.runner.greedy_reference(ids, 12, eos())
        assert done[rid].finish.reason is FinishReason.LENGTH


def test_prefix_caching_on_or_off_gives_identical_tokens_and_on_hits_the_cache():
    shared = prompt(23, salt=1)
    whole_blocks = prompt(24, salt=2)  # a full hit must still recompute the last token for its logits
    prompts = [shared + prompt(k, salt=10 + k) for k in (1, 6, 13)] + [shared, whole_blocks, whole_blocks]

    def run(enable: bool) -> tuple[dict, int]:
        test = make_engine(enable_prefix_caching=enable)
        results = {}
        for i, ids in enumerate(prompts):  # one after another, so later ones can reuse earlier blocks
            test.engine.add_request(request(f"r{i}", ids, max_tokens=10))
            results.update(test.run())
        return {rid: r.token_ids for rid, r in results.items()}, sum(
            r.finish.usage.cached_prompt_tokens for r in results.values()
        )

    on, cached_on = run(True)
    off, cached_off = run(False)
    assert on == off
    assert cached_off == 0
    assert cached_on >= 3 * 20, "the shared 23-token prefix (5 full blocks of 4) should be reused"


def test_a_sequence_decodes_the_same_alone_as_in_a_batch_of_16():
    target = prompt(17, salt=3)
    alone = make_engine()
    alone.engine.add_request(request("target", target, max_tokens=20))
    expected = alone.run()["target"].token_ids

    batched = make_engine(max_running_requests=16, max_batched_tokens=1024, num_kv_blocks=512)
    for i in range(15):
        batched.engine.add_request(request(f"other{i}", prompt(3 + 5 * i, salt=20 + i), max_tokens=10 + i))
    batched.engine.add_request(request("target", target, max_tokens=20))
    done = batched.run()
    assert done["target"].token_ids == expected
    assert max(len(batch) for batch in batched.runner.batches) == 16, "all 16 ran in one batch at some step"


def test_preempt_and_recompute_gives_the_same_tokens():
    prompts = {f"r{i}": prompt(10 + 3 * i, salt=40 + i) for i in range(6)}
    roomy = make_engine()
    for rid, ids in prompts.items():
        roomy.engine.add_request(request(rid, ids, max_tokens=24))
    expected = {rid: r.token_ids for rid, r in roomy.run().items()}

    # 24 blocks of 4 tokens cannot hold six requests growing to 34..49 tokens: preemptions must happen.
    tight = make_engine(num_kv_blocks=24, max_running_requests=6, max_batched_tokens=32)
    for rid, ids in prompts.items():
        tight.engine.add_request(request(rid, ids, max_tokens=24))
    got = {rid: r.token_ids for rid, r in tight.run().items()}
    assert tight.engine.stats.preemptions > 0
    assert got == expected


def test_cancel_frees_all_blocks_within_one_step():
    test = make_engine()
    engine = test.engine
    for i in range(3):
        engine.add_request(request(f"r{i}", prompt(30, salt=i), max_tokens=50))
    for _ in range(4):
        engine.step()
    used_before = engine.kv.num_used_blocks
    victim = next(s for s in engine.scheduler.running if s.request_id == "r1")
    victim_blocks = len(victim.block_table)
    assert victim_blocks > 0

    engine.cancel("r1")
    engine.step()
    cancelled = [o for o in test.outputs if o.request_id == "r1" and o.finish is not None]
    assert [o.finish.reason for o in cancelled] == [FinishReason.CANCELLED]
    # The other two grew by at most one block each in that step.
    assert engine.kv.num_used_blocks <= used_before - victim_blocks + 2

    engine.cancel("r0")
    engine.cancel("r2")
    engine.step()
    assert engine.kv.num_used_blocks == 0
    assert engine.stats.kv_blocks_used == 0 and engine.stats.running_requests == 0
    assert not engine.has_unfinished_requests()


def test_cancel_of_a_waiting_request_removes_it_from_the_queue():
    test = make_engine(max_running_requests=1, max_batched_tokens=16)
    test.engine.add_request(request("running", prompt(8), max_tokens=30))
    test.engine.step()
    test.engine.add_request(request("queued", prompt(8, salt=2), max_tokens=30))
    test.engine.step()
    assert test.engine.stats.waiting_requests == 1
    test.engine.cancel("queued")
    test.engine.step()
    assert test.engine.stats.waiting_requests == 0
    assert test.engine.stats.running_requests == 1


def test_kv_events_replayed_into_an_index_reproduce_the_pools_hashes():
    # A small pool: blocks get cached, evicted and reused across many requests.
    test = make_engine(num_kv_blocks=40, max_running_requests=4, max_batched_tokens=32)
    snapshot, subscription = test.engine.events.subscribe(lambda: None)
    index = set(snapshot.block_hashes)
    last = snapshot.sequence_number
    shared = prompt(12, salt=7)
    for i in range(12):
        ids = (shared if i % 2 else []) + prompt(9 + i, salt=50 + i)
        test.engine.add_request(request(f"r{i}", ids, max_tokens=7))
        for _ in range(3):
            test.engine.step()
        for batch in subscription.take():
            assert batch.sequence_number == last + 1
            last = batch.sequence_number
            apply_events(index, batch.events)
        assert index == test.engine.kv.pool.cached_hashes()
    test.run()
    for batch in subscription.take():
        apply_events(index, batch.events)
    assert index == test.engine.kv.pool.cached_hashes()
    assert any(r.finish.usage.cached_prompt_tokens for r in results(test.outputs).values())
    # A late subscriber's snapshot is the same set.
    assert set(test.engine.events.snapshot().block_hashes) == index


def test_chunked_prefill_splits_a_long_prompt_while_others_keep_decoding():
    test = make_engine(max_batched_tokens=16, max_running_requests=4)
    test.engine.add_request(request("short", prompt(6), max_tokens=40))
    for _ in range(3):
        test.engine.step()
    test.engine.add_request(request("long", prompt(100, salt=9), max_tokens=4))
    runner_batches_before = len(test.runner.batches)
    done = test.run()
    later = test.runner.batches[runner_batches_before:]
    long_chunks = [n for batch in later for start, n in batch if n > 1]
    assert sum(long_chunks) == 100 and max(long_chunks) <= 15, "the prompt came in chunks within the budget"
    prefill_steps = [batch for batch in later if any(n > 1 for _, n in batch)]
    assert all(any(n == 1 for _, n in batch) for batch in prefill_steps), "the short one decoded every step"
    assert done["long"].token_ids == test.runner.greedy_reference(prompt(100, salt=9), 4, eos())


def test_seeded_sampling_is_reproducible_alone_or_batched_and_depends_on_the_seed():
    ids = prompt(11, salt=4)

    def sampled(seed: int, others: int) -> list[int]:
        test = make_engine()
        for i in range(others):
            test.engine.add_request(
                request(f"o{i}", prompt(5 + i, salt=i), max_tokens=6, temperature=1.0, seed=i)
            )
        test.engine.add_request(request("x", ids, max_tokens=16, temperature=1.0, top_p=0.9, seed=seed))
        return test.run()["x"].token_ids

    assert sampled(7, 0) == sampled(7, 5)
    assert sampled(7, 0) != sampled(8, 0)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_k": 5, "seed": 3}])
def test_resumed_output_continues_exactly_like_the_uninterrupted_request(sampling):
    ids = prompt(14, salt=5)
    whole = make_engine()
    whole.engine.add_request(request("a", ids, max_tokens=16, **sampling))
    full = whole.run()["a"]

    resumed = make_engine()
    cut = 6
    resumed.engine.add_request(
        request("b", ids, max_tokens=16, resumed=tuple(full.token_ids[:cut]), **sampling)
    )
    rest = resumed.run()["b"]
    assert rest.first_index == cut
    assert rest.token_ids == full.token_ids[cut:]
    assert rest.finish.usage.completion_tokens == 16 - cut
    assert rest.finish.usage.prompt_tokens == len(ids) + cut
    # The first engine's text up to the cut plus the new engine's text is the whole text.
    first_part = "".join(o.text for o in whole.outputs if o.index < cut)
    assert first_part + rest.text == full.text


def test_text_held_back_where_a_request_is_resumed_is_released_by_the_engine_that_goes_on():
    """At a failover the client has tokens whose text the first engine held back: an unfinished UTF-8
    character, the start of a stop string. Resumed after any of its tokens, the request's text from
    the second engine completes the first one's exactly, and a stop string begun before the cut
    matches after it."""
    tok = tokenizer()
    # Words, and pieces of characters split across tokens.
    candidates = word_tokens() + tok.encode(" 東京 🙂 café ½")
    stop = (" dog sat", " 🙂 the")
    ids = prompt(14, salt=6)
    whole = make_engine(TokenFunctionRunner(tok.vocab_size, candidates))
    whole.engine.add_request(request("a", ids, max_tokens=32, stop=stop))
    full = whole.run()["a"]
    assert full.finish.reason == FinishReason.STOP and full.finish.matched_stop == " dog sat"
    held = []
    for cut in range(1, len(full.token_ids)):
        before = "".join(o.text for o in whole.outputs if o.index < cut)
        held.append(tok.decode(full.token_ids[:cut]).removeprefix(before))
        resumed = make_engine(TokenFunctionRunner(tok.vocab_size, candidates))
        resumed.engine.add_request(
            request("b", ids, max_tokens=32, resumed=tuple(full.token_ids[:cut]), stop=stop)
        )
        rest = resumed.run()["b"]
        assert rest.token_ids == full.token_ids[cut:], cut
        assert before + rest.text == full.text, cut
        assert (rest.finish.reason, rest.finish.matched_stop) == (full.finish.reason, " dog sat"), cut
    # The cuts the test needs: inside a character, inside a stop string that goes on not to match, and
    # inside the one that matches (the last token completes it).
    assert "\ufffd" in held and " 🙂" in held and held[-1] == " dog"


def test_resumed_output_that_already_reached_max_tokens_finishes_at_once():
    test = make_engine()
    test.engine.add_request(request("done", prompt(9), max_tokens=3, resumed=tuple(prompt(3, salt=8))))
    test.engine.step()
    [out] = test.outputs
    assert out.finish.reason is FinishReason.LENGTH and out.index == 3 and out.token_ids == []
    assert test.engine.kv.num_used_blocks == 0


def test_stop_token_ids_eos_and_max_tokens_set_the_finish_reason():
    ids = prompt(10, salt=6)
    test = make_engine()
    greedy = test.runner.greedy_reference(ids, 10, frozenset())
    stop_at = greedy[4]
    test.engine.add_request(request("stop", ids, max_tokens=10, stop_token_ids=frozenset({stop_at})))
    test.engine.add_request(request("length", ids, max_tokens=10))
    done = test.run()
    stop = done["stop"]
    assert stop.finish.reason is FinishReason.STOP
    assert stop.token_ids == greedy[: greedy.index(stop_at) + 1], "the stop token is the last token"
    assert stop.finish.matched_stop == tokenizer().decode([stop_at])
    assert stop.text == tokenizer().decode(greedy[: greedy.index(stop_at)]), "no text for the stop token"
    assert done["length"].finish.reason is FinishReason.LENGTH and len(done["length"].token_ids) == 10


def test_stop_string_cuts_the_text_and_ends_generation():
    ids = prompt(10, salt=6)
    test = make_engine()
    greedy = test.runner.greedy_reference(ids, 12, frozenset())
    full_text = tokenizer().decode(greedy)
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 4]
    test.engine.add_request(request("s", ids, max_tokens=12, stop=(stop,)))
    res = test.run()["s"]
    assert res.finish.reason is FinishReason.STOP and res.finish.matched_stop == stop
    assert res.text == full_text[: full_text.index(stop)]


def test_queue_full_and_duplicate_ids_are_refused():
    test = make_engine(max_waiting_requests=2)
    test.engine.add_request(request("a", prompt(4)))
    with pytest.raises(DuplicateRequestError):
        test.engine.add_request(request("a", prompt(4)))
    test.engine.add_request(request("b", prompt(4)))
    with pytest.raises(QueueFullError) as full:
        test.engine.add_request(request("c", prompt(4)))
    assert full.value.retry_after_s > 0


def one_running(max_tokens: int, **config: object) -> tuple[list[float], DrivenEngine]:
    """An engine on a clock the test moves (``now[0]``), with a request ``running`` already started."""
    now = [0.0]
    test = make_engine(clock=lambda: now[0], **config)
    test.engine.add_request(request("running", prompt(4), max_tokens=max_tokens))
    test.engine.step()
    return now, test


def test_a_request_past_its_queue_limit_is_refused_resource_exhausted_and_the_rest_are_served():
    now, test = one_running(6, max_running_requests=1, max_batched_tokens=8)
    test.engine.add_request(request("limited", prompt(4, salt=1), max_tokens=3, max_queue_s=0.5))
    test.engine.add_request(request("patient", prompt(4, salt=2), max_tokens=3))
    test.engine.step()
    now[0] = 0.5
    test.engine.step()
    assert test.engine.stats.waiting_requests == 1, "the limited request left the queue"
    done = test.run()
    refused = done["limited"].finish
    assert refused.refusal is not None and not refused.error
    assert refused.refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refused.refusal.retry_after_s is not None and refused.refusal.retry_after_s > 0
    assert done["limited"].token_ids == []
    assert len(done["running"].token_ids) == 6 and len(done["patient"].token_ids) == 3
    assert not test.engine.failure


def test_a_request_whose_limit_passed_during_a_long_step_starts_when_there_is_room():
    # The limit is for waiting on a full engine, not for the step that was running when it arrived: a
    # slow step (a big batch on a CPU, or a null engine paced at 1 token/s) must not refuse a request
    # the next step has room for.
    now, test = one_running(4, max_running_requests=4, max_batched_tokens=32)
    test.engine.add_request(request("limited", prompt(4, salt=1), max_tokens=3, max_queue_s=0.05))
    now[0] = 1.0  # the step in progress ends long after the limit
    test.engine.step()
    assert test.engine.stats.running_requests == 2
    done = test.run()
    assert done["limited"].finish.refusal is None
    assert len(done["limited"].token_ids) == 3


def test_higher_priority_is_admitted_first_when_slots_are_short():
    test = make_engine(max_running_requests=1, max_batched_tokens=8)
    test.engine.add_request(request("low", prompt(4), max_tokens=3, priority=Priority.LOW))
    test.engine.add_request(request("high", prompt(4, salt=1), max_tokens=3, priority=Priority.HIGH))
    test.run()
    finished = [o.request_id for o in test.outputs if o.finish is not None]
    assert finished == ["high", "low"]


def test_a_failing_runner_ends_every_request_with_an_error_and_refuses_new_ones():
    test = make_engine()
    test.engine.add_request(request("a", prompt(6), max_tokens=5))
    test.engine.add_request(request("b", prompt(7, salt=1), max_tokens=5))
    test.runner.fail_with = RuntimeError("device lost")
    test.engine.step()
    finishes = {o.request_id: o.finish for o in test.outputs if o.finish is not None}
    assert set(finishes) == {"a", "b"}
    assert all("device lost" in f.error for f in finishes.values())
    assert not test.engine.step(), "a failed engine does not step again"
    with pytest.raises(EngineUnavailableError):
        test.engine.add_request(request("c", prompt(4)))


def test_the_step_thread_serves_requests_and_stops_cleanly():
    import threading

    test = make_engine()
    done = threading.Event()
    outputs = []

    def collect(batch):
        outputs.extend(batch)
        if sum(o.finish is not None for o in outputs) == 3:
            done.set()

    test.engine.on_outputs = collect
    test.engine.start()
    try:
        for i in range(3):
            test.engine.add_request(request(f"r{i}", prompt(5 + i, salt=i), max_tokens=6))
        assert done.wait(10), "three requests should finish"
    finally:
        test.engine.stop(timeout_s=5)
    assert not test.engine._thread.is_alive()
    with pytest.raises(EngineUnavailableError):
        test.engine.add_request(request("late", prompt(4)))
    assert {o.request_id for o in outputs if o.finish} == {"r0", "r1", "r2"}


def test_a_failure_reported_from_another_thread_stops_the_step_loop_and_ends_requests():
    import threading

    test = make_engine()
    failed = threading.Event()
    reasons: list[str] = []
    test.engine.on_failure = lambda message: (reasons.append(message), failed.set())
    ended = threading.Event()
    outputs = []

    def collect(batch):
        outputs.extend(batch)
        if any(o.finish is not None and o.finish.error for o in batch):
            ended.set()

    test.engine.on_outputs = collect
    test.engine.start()
    try:
        test.engine.add_request(request("open", prompt(5), max_tokens=10_000, ignore_eos=True))
        test.engine.fail("rank 1 exited")  # as a backend's watcher thread does when a worker dies
        assert failed.wait(10) and ended.wait(10)
    finally:
        test.engine.stop(timeout_s=5)
    assert reasons == ["rank 1 exited"] and test.engine.failure == "rank 1 exited"
    [finish] = [o.finish for o in outputs if o.finish is not None]
    assert finish.error == "rank 1 exited"
    with pytest.raises(EngineUnavailableError, match="rank 1 exited"):
        test.engine.add_request(request("late", prompt(4)))


_KNOBS = {
    "temperature": 0.9,
    "seed": 5,
    "presence_penalty": 0.6,
    "frequency_penalty": 0.4,
    "logit_bias": ((3, 1.5), (40, -2.0)),
    "min_p": 0.02,
}


def test_penalized_biased_sampling_is_the_same_alone_or_batched():
    ids = prompt(12, salt=6)

    def sampled(others: int) -> list[int]:
        test = make_engine()
        for i in range(others):
            test.engine.add_request(
                request(f"o{i}", prompt(4 + i, salt=i), max_tokens=5, temperature=1.0, seed=i)
            )
        test.engine.add_request(request("x", ids, max_tokens=16, **_KNOBS))
        return test.run()["x"].token_ids

    assert sampled(0) == sampled(4)


def test_penalties_count_resumed_output_so_a_failover_continues_exactly():
    ids = prompt(14, salt=7)
    whole = make_engine()
    whole.engine.add_request(request("a", ids, max_tokens=16, **_KNOBS))
    full = whole.run()["a"].token_ids
    resumed = make_engine()
    resumed.engine.add_request(request("b", ids, max_tokens=16, resumed=tuple(full[:7]), **_KNOBS))
    assert resumed.run()["b"].token_ids == full[7:]


def test_logprobs_come_with_each_token_and_do_not_depend_on_the_batch():
    ids = prompt(10, salt=8)

    def outputs(others: int) -> list:
        test = make_engine()
        for i in range(others):
            test.engine.add_request(request(f"o{i}", prompt(6 + i, salt=i), max_tokens=4))
        test.engine.add_request(request("x", ids, max_tokens=8, logprobs=True, top_logprobs=3))
        test.run()
        return [(o.token_ids, o.logprobs) for o in test.outputs if o.request_id == "x" and o.token_ids]

    alone = outputs(0)
    assert alone == outputs(3)
    for token_ids, logprobs in alone:
        assert [lp.token_id for lp in logprobs] == token_ids
        for lp in logprobs:
            # Greedy: the sampled token is the likeliest, and its logprob the top one's.
            assert lp.top[0] == (lp.token_id, lp.logprob) and len(lp.top) == 3 and lp.logprob <= 0.0
    others = make_engine()
    others.engine.add_request(request("y", ids, max_tokens=4))
    others.run()
    assert all(not o.logprobs for o in others.outputs), "none unless asked"


class TimedRunner(TokenFunctionRunner):
    """Steps that take 20 ms + 1 ms a token on a clock of its own."""

    def __init__(self) -> None:
        super().__init__(tokenizer().vocab_size, word_tokens())
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def execute(self, chunks):
        self.now += 0.02 + 0.001 * sum(len(chunk.token_ids) for chunk in chunks)
        return super().execute(chunks)


def test_the_load_says_the_prompt_tokens_still_to_compute_and_the_step_time_per_token():
    runner = TimedRunner()
    test = make_engine(runner, clock=runner.clock, max_batched_tokens=16)
    engine = test.engine
    assert (engine.stats.step_fixed_s, engine.stats.step_token_s) == (0.0, 0.0), "no step yet"
    engine.add_request(request("long", prompt(40), max_tokens=30))
    engine.step()  # 16 of its 40 prompt tokens
    assert engine.stats.prefill_tokens == 24
    while engine.stats.prefill_tokens:
        engine.step()
    for _ in range(5):  # decode steps of one token each
        engine.step()
    assert engine.stats.step_fixed_s == pytest.approx(0.02) and engine.stats.step_token_s == pytest.approx(
        0.001
    )
