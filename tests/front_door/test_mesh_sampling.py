"""The sampling surface end to end through the real mesh (Envoy -> edge -> orchestrator -> router -> null
engines, whose every step scores its chosen token 100 and the rest 0): the official ``openai`` SDK,
unmodified, asks for logit bias, penalties, min-p, logprobs and ``n`` choices, and the engines' sampler
applies them."""

from __future__ import annotations

import math
import uuid

import grpc
import openai
import pytest

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.identity import CHAT_ID_HEADER
from chatmesh.tokenizer import load_tokenizer
from edge.schemas import MAX_CHOICES
from tests.fixtures.front_door import MeshFrontDoor
from tests.front_door.helpers import answer, assert_json_error
from tests.front_door.sse_client import iter_events

PROMPT = [{"role": "user", "content": "Say something."}]
# "!" is one token whose id is below every token the null engines choose, so a bias that ties it with
# their choice wins the tie (greedy: the lowest id).
BANG = load_tokenizer().encode("!")[0]


@pytest.fixture
def sdk(mesh_front_door: MeshFrontDoor, user: str) -> openai.OpenAI:
    return mesh_front_door.sdk(user)


def _model(sdk: openai.OpenAI) -> str:
    return sdk.models.list().data[0].id


def test_logit_bias_and_a_presence_penalty_reach_the_engines_sampler(sdk: openai.OpenAI):
    model = _model(sdk)
    forced = sdk.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=6, temperature=0, logit_bias={str(BANG): 100}
    )
    assert forced.choices[0].message.content == "!" * 6
    # The penalty takes 2 off "!" once it was said: it loses every later tie.
    penalized = sdk.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=6,
        temperature=0,
        logit_bias={str(BANG): 100},
        presence_penalty=2.0,
    )
    content = penalized.choices[0].message.content
    assert content.startswith("!") and content.count("!") == 1 and len(content) > 1
    # min-p at 1 keeps only the likeliest token: any temperature then decodes greedily.
    greedy = sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=6, temperature=0)
    sampled = sdk.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=6, temperature=2, extra_body={"min_p": 1.0}
    )
    assert sampled.choices[0].message.content == greedy.choices[0].message.content


def test_logprobs_in_openais_shape_streamed_or_not(sdk: openai.OpenAI):
    model = _model(sdk)
    reply = sdk.chat.completions.create(
        model=model, messages=PROMPT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content
    for entry in content:
        assert bytes(entry.bytes).decode() == entry.token
        # The chosen token scores 100 and the rest 0: it holds nearly all of the probability.
        assert -1e-6 < entry.logprob <= 0.0
        assert [top.token for top in entry.top_logprobs][:1] == [entry.token] and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[1].logprob == pytest.approx(-100 - math.log(1 + math.exp(-100)), abs=0.1)
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=PROMPT,
            max_tokens=8,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
    )
    streamed = [
        entry
        for chunk in chunks
        if chunk.choices and chunk.choices[0].logprobs
        for entry in chunk.choices[0].logprobs.content
    ]
    assert [(e.token, e.bytes) for e in streamed] == [(e.token, e.bytes) for e in content]
    plain = sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=2)
    assert plain.choices[0].logprobs is None


def test_bad_knobs_are_400_naming_them(sdk: openai.OpenAI):
    model = _model(sdk)
    for fields, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {str(BANG): 101}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # beyond the served vocabulary
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 0}, "n"),
        ({"n": MAX_CHOICES + 1}, "n"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.chat.completions.create(model=model, messages=PROMPT, max_tokens=2, **fields)
        assert refused.value.param == param, (fields, refused.value.body)


def test_grpc_callers_get_logprobs_on_complete_and_on_a_stored_send_and_too_many_is_invalid(
    mesh_front_door: MeshFrontDoor, user: str
):
    metadata = mesh_front_door.grpc_auth(user)
    with grpc.insecure_channel(mesh_front_door.envoy.grpc_target) as channel:
        chats = chat_pb2_grpc.ChatServiceStub(channel)
        options = chat_pb2.GenerationOptions(max_tokens=4, temperature=0.0, logprobs=True, top_logprobs=1)
        events = list(
            chats.Complete(
                chat_pb2.CompleteRequest(
                    messages=[chat_pb2.PromptMessage(role=chat_pb2.ROLE_USER, content="Hi.")], options=options
                ),
                metadata=metadata,
                timeout=30,
            )
        )
        deltas = [e.event.delta for e in events if e.event.HasField("delta")]
        logprobs = [lp for delta in deltas for lp in delta.logprobs]
        assert len(logprobs) == 4 and all(len(lp.top) == 1 for lp in logprobs)
        assert b"".join(lp.token_bytes for lp in logprobs).decode() == "".join(d.text for d in deltas)
        chat = chats.CreateChat(chat_pb2.CreateChatRequest(), metadata=metadata, timeout=10).chat
        send = chat_pb2.SendMessageRequest(chat_id=chat.chat_id, content="Hi.", options=options)
        stored = [e.event for e in chats.SendMessage(send, metadata=metadata, timeout=30)]
        # The same numbers on a stored chat's run (its replay and adoption: tests/orchestrator).
        assert [lp for e in stored if e.HasField("delta") for lp in e.delta.logprobs] == logprobs
        send.options.top_logprobs = 21
        with pytest.raises(grpc.RpcError) as refused:
            list(chats.SendMessage(send, metadata=metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_logprobs" in refused.value.details()


def test_the_chat_api_streams_a_stored_runs_logprobs_and_a_resumed_stream_gets_the_same(
    mesh_front_door: MeshFrontDoor, user: str
):
    with mesh_front_door.client(user) as client:
        chat_id = client.post("/v1/chats", json={}).json()["chat_id"]
        options = {"max_tokens": 40, "logprobs": True, "top_logprobs": 2}
        seen = []
        with answer(client, chat_id, "Say something.", options=options) as reply:
            assert reply.status_code == 200, reply.read()
            for event in iter_events(reply):
                seen.append(event)
                if len(seen) == 6:
                    break  # the page went away mid-answer
        run_id = seen[0].data["run_id"]
        headers = {"Last-Event-ID": str(seen[-1].seq), CHAT_ID_HEADER: chat_id}
        with client.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as reply:
            whole = seen + list(iter_events(reply))
        deltas = [e.data for e in whole if e.event == "delta"]
        assert all(len(d["logprobs"]) == d["token_count"] for d in deltas)
        streamed = [lp for d in deltas for lp in d["logprobs"]]
        assert len(streamed) == 40 and all(len(lp["top_logprobs"]) == 2 for lp in streamed)
        assert {"token", "logprob", "bytes", "top_logprobs"} == set(streamed[0])
        # Replayed from the start once it ended: every token's, as streamed.
        headers["Last-Event-ID"] = "0"
        with client.stream("GET", f"/v1/runs/{run_id}/events", headers=headers) as reply:
            replayed = [lp for e in iter_events(reply) if e.event == "delta" for lp in e.data["logprobs"]]
        assert replayed == streamed

        too_many = {"logprobs": True, "top_logprobs": 21}
        refused = client.post(f"/v1/chats/{chat_id}/messages", json={"content": "?", "options": too_many})
        assert assert_json_error(refused, 400)["param"] == "options.top_logprobs"


def _coin_flips(sdk: openai.OpenAI, **fields: object) -> dict:
    """A request whose every token is a fair draw of its seed: "!" biased to tie the engines' choice."""
    return dict(
        model=_model(sdk),
        messages=PROMPT,
        max_tokens=8,
        temperature=1,
        seed=11,
        logit_bias={str(BANG): 100},
        **fields,
    )


def test_n_choices_each_sample_with_a_seed_of_their_own_that_does_not_depend_on_n(sdk: openai.OpenAI):
    one = sdk.chat.completions.create(**_coin_flips(sdk))
    two = sdk.chat.completions.create(**_coin_flips(sdk, n=2))
    three = sdk.chat.completions.create(**_coin_flips(sdk, n=3))
    assert [choice.index for choice in three.choices] == [0, 1, 2]
    texts = [choice.message.content for choice in three.choices]
    assert len(set(texts)) == 3  # three seeds
    assert texts[0] == one.choices[0].message.content  # choice 0 is the request as asked
    assert [choice.message.content for choice in two.choices] == texts[:2]
    assert [choice.finish_reason for choice in three.choices] == ["length"] * 3
    # As OpenAI counts it: the prompt once, the completions summed.
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * 8
    assert three.usage.total_tokens == three.usage.prompt_tokens + 3 * 8


def test_n_choices_stream_as_chunks_naming_their_choice(sdk: openai.OpenAI):
    whole = sdk.chat.completions.create(**_coin_flips(sdk, n=3))
    chunks = list(
        sdk.chat.completions.create(
            **_coin_flips(sdk, n=3), stream=True, stream_options={"include_usage": True}
        )
    )
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1 and chunk.id == chunks[0].id
        choice = chunk.choices[0]
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        if choice.finish_reason is not None:
            finishes[choice.index] = choice.finish_reason
    assert texts == {i: choice.message.content for i, choice in enumerate(whole.choices)}
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 3 * 8
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def _prefix_cache_tokens(mesh_front_door: MeshFrontDoor) -> tuple[int, int]:
    """Prompt tokens (looked up, found cached) over the mesh's engines, since they started."""
    queried = hit = 0
    for engine in mesh_front_door.mesh.engines:
        with grpc.insecure_channel(engine.address) as channel:
            load = (
                engine_pb2_grpc.EngineServiceStub(channel)
                .GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
                .load
            )
        queried, hit = queried + load.prefix_queried_tokens, hit + load.prefix_hit_tokens
    return queried, hit


def test_n_choices_prefill_their_prompt_once(sdk: openai.OpenAI, mesh_front_door: MeshFrontDoor):
    with grpc.insecure_channel(mesh_front_door.mesh.engines[0].address) as channel:
        info = engine_pb2_grpc.EngineServiceStub(channel).GetModelInfo(
            engine_pb2.GetModelInfoRequest(), timeout=10
        )
    # A prompt of many blocks that no engine has seen.
    prompt = [{"role": "user", "content": f"{uuid.uuid4()} " + "Tell me about the sea and the sky. " * 40}]
    queried, hit = _prefix_cache_tokens(mesh_front_door)
    reply = sdk.chat.completions.create(
        model=_model(sdk), messages=prompt, max_tokens=4, temperature=1, seed=5, n=4
    )
    queried_after, hit_after = _prefix_cache_tokens(mesh_front_door)
    prompt_tokens = reply.usage.prompt_tokens
    assert prompt_tokens > 8 * info.block_size and len(reply.choices) == 4
    assert queried_after - queried == 4 * prompt_tokens  # each choice's run looked its prompt up
    # Computed: the prompt once, then each sibling only its last, partial block.
    computed = (queried_after - queried) - (hit_after - hit)
    assert computed <= prompt_tokens + 3 * info.block_size, (computed, prompt_tokens)
