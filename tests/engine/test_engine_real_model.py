"""The engine core (LLMEngine + scheduler + KV cache) on the real model, driven step by step.

What the token-function tests in ``test_core_engine.py`` prove about bookkeeping must also hold for
real numerics: the same greedy tokens with the prefix cache on or off, alone or in a changing batch,
preempted and recomputed or not; cancels that free every block; KV events that keep the router's index
exact; sampling that does what its parameters say.

Token comparisons use the near-tie rule of ``test_model_parity.py``: two runs of one request must give
identical tokens, except that they may part at a token where the reference forward's logits of the two
candidates are within ``LOGIT_TOL`` (0.02, 10x the float32 rounding measured between kernel
implementations); after that point they are different continuations and are not compared. The
native kernels are batch-invariant, so there every run here is in fact bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pytest

from chatmesh.block_hash import block_hashes
from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatMessage
from engine.kv_events import BlocksRemoved, BlocksStored, KvEventBatch
from engine.model.cpu_runner import CpuModelRunner
from engine.model.kernels import select_kernels
from engine.model.runner import SequenceChunk
from engine.request import SamplingParams
from engine.sampler import sample_one, uniform
from router.index import PrefixIndex
from tests.engine.core_helpers import DrivenEngine, Result, make_engine, request, results
from tests.engine.test_model_parity import LOGIT_TOL

ENGINE_ID = "engine-under-test"


class RecordingRunner:
    """The real runner, with a record of what each step computed: (tokens, needs_logits) per chunk and
    the logits it returned. Everything is computed by the wrapped runner."""

    def __init__(self, runner: CpuModelRunner) -> None:
        self._runner = runner
        self.spec = runner.spec
        self.backend = runner.backend
        self.tensor_parallel_size = runner.tensor_parallel_size
        self.steps: list[list[tuple[int, bool]]] = []
        self.logits: list[np.ndarray] = []  # one row per sampled token, in step order

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self._runner.kv_bytes_per_block(block_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._runner.allocate_kv_cache(num_blocks, block_size)

    def execute(self, chunks: Sequence[SequenceChunk]) -> np.ndarray:
        self.steps.append([(len(chunk.token_ids), chunk.needs_logits) for chunk in chunks])
        logits = self._runner.execute(chunks)
        self.logits += list(logits)
        return logits

    def close(self) -> None:
        self._runner.close()


@pytest.fixture(scope="module")
def model_runner(request: pytest.FixtureRequest, model_checkpoint) -> CpuModelRunner:
    """The kernels the engine itself picks on this CPU (native-int8 with AVX-512 VNNI, native with AVX-512
    or AVX2, numpy otherwise)."""
    kernels = select_kernels(None, None, model_checkpoint.config)
    return request.getfixturevalue(f"{kernels.name.replace('-', '_')}_runner")


@pytest.fixture(scope="module")
def chat(chat_tokenizer) -> Callable[..., list[int]]:
    def encode(user: str, system: str | None = None) -> list[int]:
        messages = [ChatMessage("system", system)] if system else []
        return chat_tokenizer.encode_chat([*messages, ChatMessage("user", user)])

    return encode


def real_engine(runner: CpuModelRunner, **config: object) -> DrivenEngine:
    """An engine on the real model with the production block size; small step budget by default, so
    prompts are prefilled in chunks."""
    settings = {"block_size": 16, "num_kv_blocks": 128, "max_batched_tokens": 64, "max_running_requests": 32}
    return make_engine(RecordingRunner(runner), **{**settings, **config})


@pytest.fixture
def assert_same_tokens(request: pytest.FixtureRequest) -> Callable[[list[int], list[int], list[int]], None]:
    """``check(got, expected, prompt)``: identical tokens up to the first near-tie (see the docstring);
    the reference forward is loaded only if the runs part."""

    def check(got: list[int], expected: list[int], prompt: list[int]) -> None:
        for i, (ours, theirs) in enumerate(zip(got, expected, strict=False)):
            if ours != theirs:
                reference = request.getfixturevalue("reference_model")
                logits = reference.logits(prompt + expected[:i])[-1]
                margin = abs(float(logits[ours] - logits[theirs]))
                assert margin < LOGIT_TOL, (
                    f"token {i}: {ours} vs {theirs}, {margin:.4f} apart: not a near-tie"
                )
                return
        assert got == expected

    return check


def num_tokens(test: DrivenEngine, request_id: str) -> int:
    """Output tokens ``request_id`` has received so far."""
    return sum(len(o.token_ids) for o in test.outputs if o.request_id == request_id)


def run_alone(runner: CpuModelRunner, prompt: list[int], max_tokens: int, **config: object) -> Result:
    test = real_engine(runner, **config)
    test.engine.add_request(request("alone", prompt, max_tokens=max_tokens))
    return test.run()["alone"]


# -- prefix cache -------------------------------------------------------------------------------------

DOCUMENT = (
    "The lighthouse keeper's log, autumn. Each evening I climb the ninety-seven steps, trim the wick, "
    "polish the great lens and write down the weather: wind from the west, a heavy swell, gulls flying "
    "low over the rocks. Ships pass far out, their lights small as stars. Supplies come by boat every "
    "second Thursday: flour, lamp oil, letters from my sister in the city, who asks when I will come "
    "home. The storms of October broke two panes in the lantern room; I patched them with canvas until "
    "the glazier could row across. On clear nights I count the ships and name the constellations, and "
    "in the mornings I walk the shore looking for what the sea has left: rope, glass floats, once a "
    "wooden horse with one ear. The island is small, but the work is never finished, and the light must "
    "never go out."
)


def test_a_follow_up_on_a_cached_prefix_gets_the_tokens_of_a_cold_run(model_runner, chat, assert_same_tokens):
    first = chat("Summarize the log in one sentence.", system=DOCUMENT)
    follow_up = chat("What broke in October?", system=DOCUMENT)
    shared = next(i for i, (a, b) in enumerate(zip(first, follow_up, strict=False)) if a != b)
    assert shared >= 160, "the follow-up must share a long prefix (10+ blocks)"

    cached = real_engine(model_runner, enable_prefix_caching=True)
    cached.engine.add_request(request("first", first, max_tokens=4))
    cached.run()
    steps_before = len(cached.runner.steps)
    cached.engine.add_request(request("follow-up", follow_up, max_tokens=12))
    warm = cached.run()["follow-up"]
    cold = run_alone(model_runner, follow_up, 12, enable_prefix_caching=False)

    hit = shared // 16 * 16
    assert warm.finish.usage.cached_prompt_tokens == hit
    assert cached.engine.stats.prefix_hit_tokens == hit
    computed = sum(n for step in cached.runner.steps[steps_before:] for n, _ in step)
    assert computed == len(follow_up) - hit + len(warm.token_ids) - 1, "only the uncached tail was prefilled"
    assert cold.finish.usage.cached_prompt_tokens == 0
    assert_same_tokens(warm.token_ids, cold.token_ids, follow_up)


# -- continuous batching ------------------------------------------------------------------------------


def test_a_sequence_decodes_the_same_alone_and_while_16_others_join_and_prefill(
    model_runner, chat, assert_same_tokens
):
    target = chat("Translate 'good morning' into Spanish.")
    alone = run_alone(model_runner, target, 10)

    test = real_engine(model_runner, max_batched_tokens=48)
    engine = test.engine
    others = [
        request(f"other{i}", chat("count: " + "ab " * (3 * i)), max_tokens=14 + i % 4) for i in range(16)
    ]
    for other in others[:4]:
        engine.add_request(other)
    engine.step()
    engine.add_request(request("target", target, max_tokens=10))
    joining = others[4:]
    target_steps = []  # per step while the target decodes: (sequences in the step, a prefill chunk in it)
    while engine.has_unfinished_requests():
        for _ in range(2):  # two more join every step, so their prefill chunks interleave with decodes
            if joining:
                engine.add_request(joining.pop(0))
        before = num_tokens(test, "target")
        engine.step()
        after = num_tokens(test, "target")
        if after > before and before > 0:
            step = test.runner.steps[-1]
            target_steps.append((len(step), any(n > 1 and not logits for n, logits in step)))
    batched = results(test.outputs)["target"]

    assert max(n for n, _ in target_steps) == 17, "the target decoded in one batch with all 16 others"
    assert any(prefill for _, prefill in target_steps), "the target decoded beside a chunked prefill"
    assert_same_tokens(batched.token_ids, alone.token_ids, target)


# -- preemption ---------------------------------------------------------------------------------------

QUESTIONS = [
    "Name three colours of the rainbow.",
    "Why is the sky blue? Answer briefly.",
    "Write one sentence about cats.",
    "What is two plus two?",
]


def test_preempted_and_recomputed_requests_get_the_tokens_of_an_unpreempted_run(
    model_runner, chat, assert_same_tokens
):
    prompts = {f"q{i}": chat(text) for i, text in enumerate(QUESTIONS)}

    def run(num_kv_blocks: int) -> tuple[dict[str, Result], int]:
        test = real_engine(model_runner, num_kv_blocks=num_kv_blocks)
        for rid, ids in prompts.items():
            test.engine.add_request(request(rid, ids, max_tokens=24, ignore_eos=True))
        return test.run(), test.engine.stats.preemptions

    roomy, roomy_preemptions = run(128)
    # Four requests growing to ~55-60 tokens need 4 blocks each (the chat template's shared first
    # block aside); 10 blocks cannot hold them all, so the newest is preempted and recomputed.
    tight, tight_preemptions = run(10)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    for rid, ids in prompts.items():
        assert len(tight[rid].token_ids) == 24
        assert_same_tokens(tight[rid].token_ids, roomy[rid].token_ids, ids)


# -- cancel -------------------------------------------------------------------------------------------


def test_cancel_mid_decode_frees_every_block_within_one_step(model_runner, chat):
    test = real_engine(model_runner, num_kv_blocks=64)
    engine, pool = test.engine, test.engine.kv.pool
    free_at_start = pool.num_free_blocks
    for i, text in enumerate(QUESTIONS[:3]):
        engine.add_request(request(f"r{i}", chat(text), max_tokens=200, ignore_eos=True))
    while min(num_tokens(test, f"r{i}") for i in range(3)) < 3:
        engine.step()

    victim = next(seq for seq in engine.scheduler.running if seq.request_id == "r1")
    own_blocks = sum(1 for b in victim.block_table if pool.blocks[b].ref_count == 1)
    used_before = pool.num_used_blocks
    engine.cancel("r1")
    engine.step()
    assert [o.finish.reason for o in test.outputs if o.request_id == "r1" and o.finish] == [
        FinishReason.CANCELLED
    ]
    # The two others decoded one token each in that step: at most one new block each.
    assert pool.num_used_blocks <= used_before - own_blocks + 2

    engine.cancel("r0")
    engine.cancel("r2")
    engine.step()
    assert pool.num_free_blocks == free_at_start
    assert engine.stats.kv_blocks_used == 0 and not engine.has_unfinished_requests()


# -- KV events ----------------------------------------------------------------------------------------


class RouterView:
    """The router's index for one engine, fed from the engine's event log the way the router's
    supervisor feeds it from the KvEvents stream: a snapshot replaces, then numbered batches apply."""

    def __init__(self, engine: DrivenEngine) -> None:
        self.index = PrefixIndex()
        self.index.add_engine(ENGINE_ID, engine.engine.kv.num_blocks)
        snapshot, self._subscription = engine.engine.events.subscribe(lambda: None)
        self.index.replace(ENGINE_ID, snapshot.block_hashes)
        self._next = snapshot.sequence_number + 1
        self.removed = 0

    def catch_up(self) -> None:
        for batch in self._subscription.take():
            self._apply(batch)

    def _apply(self, batch: KvEventBatch) -> None:
        assert batch.sequence_number == self._next, "batches are numbered +1"
        self._next += 1
        for event in batch.events:
            if isinstance(event, BlocksStored):
                self.index.store(ENGINE_ID, event.block_hashes)
            else:
                assert isinstance(event, BlocksRemoved)
                self.removed += len(event.block_hashes)
                self.index.remove(ENGINE_ID, event.block_hashes)

    def holds_exactly(self, hashes: set[int]) -> bool:
        return self.index.size(ENGINE_ID) == len(hashes) and all(
            self.index.match([h], [ENGINE_ID]).get(ENGINE_ID) == 1 for h in hashes
        )


def test_kv_events_keep_the_routers_index_equal_to_the_pools_cache_through_evictions(model_runner, chat):
    # 20 blocks: the requests below cache more than that between them, so old blocks get evicted.
    test = real_engine(model_runner, num_kv_blocks=20, max_running_requests=4)
    pool = test.engine.kv.pool
    from_start = RouterView(test)
    late = None
    prompts = [chat(text, system=DOCUMENT if i % 3 == 0 else None) for i, text in enumerate(QUESTIONS * 2)]
    for i, ids in enumerate(prompts):
        test.engine.add_request(request(f"r{i}", ids, max_tokens=3))
        for _ in range(2):
            test.engine.step()
            from_start.catch_up()
            assert from_start.holds_exactly(pool.cached_hashes())
        if i == 3:  # a router that connects mid-way starts from a snapshot
            late = RouterView(test)
    test.run()
    from_start.catch_up()
    late.catch_up()
    assert from_start.removed > 0, "the pool evicted cached blocks"
    assert late.removed > 0, "evictions happened after the late snapshot too"
    assert from_start.holds_exactly(pool.cached_hashes())
    assert late.holds_exactly(pool.cached_hashes())
    # The index answers a placement query with what the engine would actually hit.
    last = prompts[-1]
    hashes = block_hashes(last[: (len(last) - 1) // 16 * 16], 16)
    hits = next((i for i, h in enumerate(hashes) if pool.lookup(h) is None), len(hashes))
    assert from_start.index.match(hashes, [ENGINE_ID]) == {ENGINE_ID: hits} and hits > 0


# -- sampling and stop strings ------------------------------------------------------------------------


def sampled(
    runner: CpuModelRunner, prompt: list[int], **params: object
) -> tuple[list[int], list[np.ndarray]]:
    """One request alone: its tokens and, for each, the logits it was drawn from."""
    test = real_engine(runner)
    test.engine.add_request(request("s", prompt, **params))
    tokens = test.run()["s"].token_ids
    assert len(test.runner.logits) == len(tokens)
    return tokens, test.runner.logits


def test_seeded_sampling_depends_only_on_the_seed(model_runner, chat):
    poem = chat("Write a short poem about the sea.")
    test = real_engine(model_runner)
    for rid, seed in (("a", 7), ("b", 7), ("c", 8)):
        test.engine.add_request(request(rid, poem, max_tokens=16, temperature=1.0, seed=seed))
    done = test.run()
    assert done["a"].token_ids == done["b"].token_ids, "same seed, same tokens, side by side in one batch"
    assert done["a"].token_ids != done["c"].token_ids, "another seed draws other tokens"


@pytest.mark.parametrize(
    "params",
    [{"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.5}, {"temperature": 1.0}],
    ids=["top-k", "top-p", "temperature"],
)
def test_each_token_is_the_seeded_draw_under_the_requests_temperature_top_k_and_top_p(
    model_runner, chat, params
):
    params = {**params, "seed": 11}
    tokens, logits = sampled(model_runner, chat("Write a short poem about the sea."), max_tokens=12, **params)
    sampling = SamplingParams(**params)
    for i, (token, row) in enumerate(zip(tokens, logits, strict=True)):
        assert token == sample_one(row, sampling, uniform(11, i)), (
            f"token {i} is not the draw for (seed, {i})"
        )
        order = np.argsort(-row, kind="stable")
        if "top_k" in params:
            assert token in order[: params["top_k"]]
        if "top_p" in params:
            probs = np.exp((row[order] - row[order[0]]) / params["temperature"])
            nucleus = np.searchsorted(np.cumsum(probs) / probs.sum(), params["top_p"]) + 1
            assert token in order[:nucleus]


def test_top_k_1_and_a_tiny_top_p_are_greedy_at_any_temperature(model_runner, chat):
    prompt = chat("Write a short poem about the sea.")
    greedy, _ = sampled(model_runner, prompt, max_tokens=8)
    assert sampled(model_runner, prompt, max_tokens=8, temperature=1.5, top_k=1, seed=3)[0] == greedy
    assert sampled(model_runner, prompt, max_tokens=8, temperature=1.5, top_p=1e-6, seed=3)[0] == greedy


def test_a_stop_string_ends_the_text_exactly_before_it(model_runner, chat, chat_tokenizer):
    prompt = chat("What is the capital of France? Answer in one sentence.")  # not a near-tie
    full = run_alone(model_runner, prompt, 16)
    text = chat_tokenizer.decode(full.token_ids)
    assert "Paris" in text
    stop = "aris"  # starts inside a token: the text before it is released, "aris" never is
    test = real_engine(model_runner)
    test.engine.add_request(request("stop", prompt, max_tokens=16, stop=(stop, "no such text")))
    stopped = test.run()["stop"]
    assert stopped.finish.reason is FinishReason.STOP and stopped.finish.matched_stop == stop
    assert stopped.text == text[: text.index(stop)]
    assert len(stopped.token_ids) < len(full.token_ids), "generation ended at the stop string"
