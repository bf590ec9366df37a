"""kill -9 of a real-model engine mid-stream: the stream finishes on another engine, and its greedy
output equals an unbroken run's, under the engine tests' near-tie rule (two outputs may part only
where the reference model's two best logits are within LOGIT_TOL of each other).
"""

import signal

import grpc
import numpy as np
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tokenizer import ChatMessage, load_tokenizer
from tests.router.router_client import Stream, generate

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cpu_pair(start_engines, start_router):
    # One compute thread each: two engines share the machine's two cores.
    engines = start_engines(2, "cpu", threads=1, num_kv_blocks=256)
    return start_router(engines)


def greedy(prompt: list[int], request_id: str) -> router_pb2.GenerateStart:
    return router_pb2.GenerateStart(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling=engine_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


def assert_same_greedy_output(prompt: list[int], ours: list[int], unbroken: list[int], request) -> None:
    if ours == unbroken:
        return
    from tests.engine.test_model_parity import LOGIT_TOL

    i = next(i for i, (a, b) in enumerate(zip(ours, unbroken, strict=True)) if a != b)
    logits = request.getfixturevalue("reference_model").logits(prompt + unbroken[:i])[-1]
    best_two = np.argsort(logits)[-2:]
    assert {ours[i], unbroken[i]} <= set(best_two.tolist()), f"token {i}: neither run took a near-best token"
    margin = logits[best_two[1]] - logits[best_two[0]]
    assert margin < LOGIT_TOL, f"token {i} differs without a near-tie (margin {margin:.4f})"


async def test_kill_9_mid_stream_continues_elsewhere_with_the_same_greedy_output(
    cpu_pair, engine_launcher, request
):
    tok = load_tokenizer()
    prompt = tok.encode_chat([ChatMessage("user", "Write a short story about a lighthouse keeper.")])
    async with grpc.aio.insecure_channel(cpu_pair.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        unbroken = await generate(stub, greedy(prompt, "unbroken"))
        stream = Stream.start(stub, greedy(prompt, "interrupted"))  # the prefix sends it to the same engine
        victim = (await stream.until("routed")).routed.engine_id
        while len(stream.outcome.token_ids) < 8:
            await stream.until("tokens")
        engine_launcher.signal(victim, signal.SIGKILL)
        engine_launcher.forget(victim)
        outcome = await stream.rest()
    assert [r.attempt for r in outcome.routed] == [1, 2] and outcome.routed[1].engine_id != victim
    assert outcome.tokens_after_routed[0] >= 8 and outcome.tokens_after_routed[1] > 0
    assert len(outcome.token_ids) == MAX_TOKENS
    assert outcome.finished.usage.completion_tokens == MAX_TOKENS
    assert outcome.finished.usage.prompt_tokens == len(prompt)
    assert_same_greedy_output(prompt, outcome.token_ids, unbroken.token_ids, request)
    if outcome.token_ids == unbroken.token_ids:
        assert outcome.text == unbroken.text
        assert outcome.pieces == unbroken.pieces, "each token released the same text on either engine"
