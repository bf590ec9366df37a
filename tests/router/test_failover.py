"""Failover: an engine that dies (kill -9) or hangs (SIGSTOP) mid-stream or before its first token, and
the stream goes on elsewhere with no token lost or repeated.

Null-backend engines emit a deterministic token per sequence position, so an unbroken run of the same
prompt is the reference an interrupted stream must equal (the greedy real-model version of this test is
in test_failover_cpu.py).
"""

import signal

import grpc
import pytest

from chatmesh.errors import ServiceError
from chatmesh.router.v1 import router_pb2, router_pb2_grpc
from chatmesh.tokenizer import ChatMessage
from tests.engine.service_client import wait_until
from tests.router.router_client import Outcome, Stream, generate, list_engines, start_frame

TOKENS_PER_S = 50  # slow enough that a stream is still running when the test strikes
STALL_TIMEOUT_S = 2.0  # the router's accept and idle timeouts here


@pytest.fixture(scope="module")
def cluster(start_engines, start_router):
    engines = start_engines(4, "null", null_tokens_per_s=TOKENS_PER_S)
    router = start_router(engines, accept_timeout_s=STALL_TIMEOUT_S, idle_timeout_s=STALL_TIMEOUT_S)
    return router


@pytest.fixture
async def stub(cluster):
    async with grpc.aio.insecure_channel(cluster.address) as channel:
        yield router_pb2_grpc.RouterServiceStub(channel)


@pytest.fixture
def stopped(engine_launcher):
    """Engines the test SIGSTOPs; they are continued afterwards whatever happens."""
    names: list[str] = []
    yield names
    for name in names:
        engine_launcher.signal(name, signal.SIGCONT)


def prompt_for(tok, topic: str) -> list[int]:
    return tok.encode_chat(
        [ChatMessage("system", f"You write about {topic}. " * 10), ChatMessage("user", "Go.")]
    )


async def live_engines_healthy(stub, cluster, engine_launcher) -> bool:
    """Every engine of the cluster that is still running (not killed) is healthy in the router's view."""
    engines = await list_engines(stub)
    return all(engines[e.name].healthy for e in cluster.engines if e.name in engine_launcher.running)


def kill(engine_launcher, name: str) -> None:
    engine_launcher.signal(name, signal.SIGKILL)
    engine_launcher.forget(name)


async def test_kill_9_mid_stream_continues_on_another_engine_without_gaps_or_repeats(
    stub, tok, cluster, engine_launcher
):
    prompt = prompt_for(tok, "rivers")
    reference = await generate(stub, start_frame(prompt, max_tokens=120))
    stream = Stream.start(stub, start_frame(prompt, max_tokens=120, session_id="river-chat"))
    victim = (await stream.until("routed")).routed.engine_id
    await stream.until("tokens")
    kill(engine_launcher, victim)
    # Marked unhealthy from its broken streams, well before the stale-load timeout (5 s).
    await wait_until(lambda: _unhealthy(stub, victim), timeout_s=2.0, what=f"{victim} marked unhealthy")
    outcome = await stream.rest()
    assert [r.attempt for r in outcome.routed] == [1, 2]
    assert outcome.routed[1].engine_id != victim
    assert all(count > 0 for count in outcome.tokens_after_routed), "tokens came from both engines"
    assert outcome.token_ids == reference.token_ids
    assert outcome.text == reference.text
    assert outcome.pieces == reference.pieces, "each token released the same text on either engine"
    usage = outcome.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), 120)
    assert (await list_engines(stub))[victim].indexed_blocks == 0, "a dead engine's blocks leave the index"


async def _unhealthy(stub, engine_id: str) -> bool:
    return not (await list_engines(stub))[engine_id].healthy


async def test_a_hung_engine_mid_stream_times_out_and_the_stream_continues(
    stub, tok, cluster, engine_launcher, stopped
):
    await wait_until(
        lambda: live_engines_healthy(stub, cluster, engine_launcher), what="live engines healthy"
    )
    prompt = prompt_for(tok, "mountains")
    reference = await generate(stub, start_frame(prompt, max_tokens=100))
    stream = Stream.start(stub, start_frame(prompt, max_tokens=100))
    hung = (await stream.until("routed")).routed.engine_id
    await stream.until("tokens")
    engine_launcher.signal(hung, signal.SIGSTOP)
    stopped.append(hung)
    outcome = await stream.rest()
    assert [r.engine_id != hung for r in outcome.routed] == [False, True]
    assert outcome.token_ids == reference.token_ids


async def test_before_the_first_token_the_request_is_just_retried_elsewhere(
    stub, tok, cluster, engine_launcher, stopped
):
    await wait_until(
        lambda: live_engines_healthy(stub, cluster, engine_launcher), what="live engines healthy"
    )
    prompt = prompt_for(tok, "deserts")
    home = (await generate(stub, start_frame(prompt, max_tokens=2))).engine_id
    # The router still thinks `home` is fine (its load reports are not stale yet) and it holds the prefix.
    engine_launcher.signal(home, signal.SIGSTOP)
    stopped.append(home)
    outcome = await generate(stub, start_frame(prompt, max_tokens=30))
    assert [r.engine_id == home for r in outcome.routed] == [True, False]
    assert outcome.tokens_after_routed == [0, 30]
    assert outcome.finished.usage.completion_tokens == 30


async def test_attempts_are_bounded_then_the_request_fails_with_a_clear_unavailable(
    tok, start_engines, start_router, engine_launcher
):
    [engine] = start_engines(1, "null", null_tokens_per_s=TOKENS_PER_S)
    router = start_router([engine])
    async with grpc.aio.insecure_channel(router.address) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        stream = Stream.start(stub, start_frame(prompt_for(tok, "oceans"), max_tokens=500))
        await stream.until("tokens")
        kill(engine_launcher, engine.name)
        with pytest.raises(ServiceError) as err:
            await stream.rest()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert engine.name in err.value.message and "no healthy engine" in err.value.message
    assert stream.outcome.token_ids, "the client had tokens before the failure"
    assert stream.outcome.finished is None


# Stop strings that hold text back on the null engines' text ("... lazy dog. A journey of a thousand
# miles begins with a single step. ..."): from "." after "dog" the text may still be the stop string's start.
HELD_TO_SINGLE = (
    ". A journey of a thousand miles begins with a single sneeze"  # never matches: released at " step"
)
HELD_TO_BEGINS = ". A journey of a thousand miles begins"  # matches at " begins"


@pytest.mark.parametrize("stop", [HELD_TO_SINGLE, HELD_TO_BEGINS], ids=["released-later", "matched-across"])
async def test_text_held_back_at_a_stop_string_prefix_survives_a_kill_9(
    stub, tok, cluster, engine_launcher, stop
):
    """The client has tokens whose text the dead engine held back (". A", the start of ``stop``): the
    engine that goes on replays them into the same held-back state, so that text reaches the client
    (with " step") or the stop string matches across the two engines, exactly as without the failure."""
    await wait_until(
        lambda: live_engines_healthy(stub, cluster, engine_launcher), what="live engines healthy"
    )
    prompt = prompt_for(tok, "proverbs")

    def request() -> router_pb2.GenerateStart:
        start = start_frame(prompt, max_tokens=70)
        start.sampling.stop.append(stop)
        return start

    reference = await generate(stub, request())
    stream = Stream.start(stub, request())
    victim = (await stream.until("routed")).routed.engine_id
    # Strike while the engine holds ". A" back: the client has the tokens, not their text.
    while held_back(tok, stream.outcome) != ". A":
        assert (await stream.read()).WhichOneof("kind") == "tokens", "finished before the text was held"
    kill(engine_launcher, victim)
    outcome = await stream.rest()
    assert [r.attempt for r in outcome.routed] == [1, 2]
    cut = outcome.tokens_after_routed[0]
    failed_over_at = Outcome(token_ids=outcome.token_ids[:cut], pieces=outcome.pieces[:cut])
    assert held_back(tok, failed_over_at).startswith(". A"), "the engine died while it held text back"
    assert outcome.tokens_after_routed[1] > 0, "the second engine went on"
    assert outcome.token_ids == reference.token_ids
    assert outcome.text == reference.text
    assert outcome.pieces == reference.pieces
    assert outcome.finished.finish_reason == reference.finished.finish_reason
    assert outcome.finished.matched_stop == reference.finished.matched_stop
    if stop == HELD_TO_BEGINS:
        assert outcome.finished.matched_stop == stop and outcome.text.endswith(" lazy dog")
    else:
        assert ". A journey of a thousand miles begins with a single step." in outcome.text


async def test_a_request_resumed_after_its_last_token_ends_with_the_text_held_back_at_the_end(
    stub, tok, cluster, engine_launcher
):
    """The stream broke after the last token and before `finished` (its router died there, or the
    replica relaying it): the orchestrator asks again with every token. Nothing is left to generate but
    the end the broken stream would have had: `finished` (length) with the text held back at the end."""
    await wait_until(
        lambda: live_engines_healthy(stub, cluster, engine_launcher), what="live engines healthy"
    )
    prompt = prompt_for(tok, "proverbs")

    def request(max_tokens: int) -> router_pb2.GenerateStart:
        start = start_frame(prompt, max_tokens=max_tokens)
        start.sampling.stop.append(HELD_TO_SINGLE)
        return start

    whole = await generate(stub, request(70))
    # Output long enough to end holding ". A" back.
    length = next(
        n
        for n in range(1, 71)
        if held_back(tok, Outcome(token_ids=whole.token_ids[:n], pieces=whole.pieces[:n])) == ". A"
    )
    unbroken = await generate(stub, request(length))
    assert unbroken.finished.text == ". A"  # flushed at the max-tokens finish
    resumed = request(length)
    resumed.resumed_output_token_ids[:] = unbroken.token_ids
    outcome = await generate(stub, resumed)
    assert outcome.token_ids == [] and outcome.finished.finish_reason == unbroken.finished.finish_reason
    assert outcome.finished.text == ". A"
    usage = outcome.finished.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt), length)


def held_back(tok, outcome: Outcome) -> str:
    """The text of the client's tokens that it has not got yet (held back at a stop string's start)."""
    released = "".join(text for _, text in outcome.pieces)
    decoded = tok.decode(outcome.token_ids)
    assert decoded.startswith(released)
    return decoded[len(released) :]
