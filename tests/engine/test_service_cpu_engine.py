"""EngineService over real gRPC against a real ``python -m engine --backend cpu`` process (the real model).

Validation every backend shares is proven on the null engine (``test_service_engine.py``); here: the
real model answers, the real engine's own context window is enforced at its exact boundary, and the
sampling values that test does not cover are refused with INVALID_ARGUMENT.
"""

import math

import grpc
import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from tests.engine.core_helpers import released_pieces
from tests.engine.service_client import TIMEOUT_S, Stream, capital_question, engine_stub, start_frame


@pytest.fixture
async def stub(cpu_engine):
    async with engine_stub(cpu_engine.address) as stub:
        yield stub


async def test_the_real_model_answers_paris(stub, chat_tokenizer):
    prompt = capital_question(chat_tokenizer)
    outcome = await Stream.start(stub, start_frame("paris", prompt, max_tokens=16)).rest()
    assert "Paris" in outcome.text
    assert outcome.text == chat_tokenizer.decode(outcome.token_ids)
    assert outcome.pieces == released_pieces(chat_tokenizer, outcome.token_ids)
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_STOP, "the model ends its answer"
    assert outcome.finished.usage.prompt_tokens == len(prompt)


async def test_prompt_plus_max_tokens_may_fill_the_context_window_but_not_exceed_it(stub, chat_tokenizer):
    prompt = capital_question(chat_tokenizer)
    info = await stub.GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT_S)
    room = info.context_length - len(prompt)
    with pytest.raises(ServiceError) as err:
        await Stream.start(stub, start_frame("too-long", prompt, max_tokens=room + 1)).rest()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "context window" in err.value.message
    # Exactly full is allowed; the model stops on its own long before.
    outcome = await Stream.start(stub, start_frame("full", prompt, max_tokens=room)).rest()
    assert outcome.finished.finish_reason == engine_pb2.FINISH_REASON_STOP


BAD_SAMPLING = {
    "negative temperature": ({"temperature": -0.5}, "temperature"),
    "NaN temperature": ({"temperature": math.nan}, "temperature"),
    "top_p above 1": ({"top_p": 1.5}, "top_p"),
    "negative top_p": ({"top_p": -0.1}, "top_p"),
    "empty stop string": ({"stop": [""]}, "stop strings"),
    "too many stop strings": ({"stop": [f"s{i}" for i in range(17)]}, "stop strings"),
    "stop token beyond the vocabulary": ({"stop_token_ids": [10**6]}, "vocabulary"),
}


@pytest.mark.parametrize("case", BAD_SAMPLING, ids=list(BAD_SAMPLING))
async def test_bad_sampling_values_are_invalid_arguments(stub, chat_tokenizer, case):
    prompt = capital_question(chat_tokenizer)
    change, mentions = BAD_SAMPLING[case]
    start = start_frame("bad-sampling", prompt, max_tokens=4)
    for name, value in change.items():
        if isinstance(value, list):
            getattr(start.sampling, name).extend(value)
        else:
            setattr(start.sampling, name, value)
    with pytest.raises(ServiceError) as err:
        await Stream.start(stub, start).rest()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert mentions in err.value.message
