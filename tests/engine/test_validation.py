"""A GenerateStart's sampling knobs as the engine takes them, and a hosted backend's refusal of those its
sampler is not given."""

from __future__ import annotations

import pytest

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from engine.validation import ServedModel, request_from_proto

OURS = ServedModel(name="m", tokenizer_fingerprint="", vocab_size=100, context_length=64)
HOSTED = ServedModel(
    name="m", tokenizer_fingerprint="", vocab_size=100, context_length=64, serves_extra_knobs=False
)


def start(**knobs: object) -> engine_pb2.GenerateStart:
    sampling = engine_pb2.SamplingParams(max_tokens=4, **knobs)
    return engine_pb2.GenerateStart(request_id="r", prompt_token_ids=[1, 2], sampling=sampling)


def test_the_knobs_reach_the_samplers_params():
    params = request_from_proto(
        start(
            presence_penalty=0.5,
            frequency_penalty=-1.0,
            logit_bias={9: -2.0, 3: 4.0},
            min_p=0.25,
            logprobs=True,
            top_logprobs=5,
        ),
        OURS,
    ).sampling
    assert (params.presence_penalty, params.frequency_penalty, params.min_p) == (0.5, -1.0, 0.25)
    assert params.logit_bias == ((3, 4.0), (9, -2.0)) and params.adjusts_logits and params.penalizes
    assert (params.logprobs, params.top_logprobs) == (True, 5)
    assert request_from_proto(start(top_logprobs=5), OURS).sampling.top_logprobs == 0, "only with logprobs"
    assert not request_from_proto(start(), OURS).sampling.adjusts_logits


@pytest.mark.parametrize(
    "knobs",
    [{"presence_penalty": 0.1}, {"logit_bias": {3: 1.0}}, {"min_p": 0.1}, {"logprobs": True}],
    ids=["penalty", "bias", "min-p", "logprobs"],
)
def test_a_hosted_backend_refuses_knobs_its_sampler_is_not_given(knobs):
    with pytest.raises(ServiceError) as refused:
        request_from_proto(start(**knobs), HOSTED)
    assert refused.value.code.name == "INVALID_ARGUMENT"
    assert f"sampling.{next(iter(knobs))} is not served by this engine's backend" in refused.value.message
    assert request_from_proto(start(temperature=0.5, top_p=0.9), HOSTED).sampling.temperature == 0.5
