"""Prompt-lookup speculative decoding on the real model: answers grounded in their input (repeat a
text, edit code, extract into a JSON schema) are token for token the answers without speculation,
greedy and seeded, alone and batched, constrained or free, with the same logprobs; and their drafts
are accepted (the test exercises verification, not a step that drafted nothing).

Token comparisons use the near-tie rule of ``test_engine_real_model.py``: on the native kernels, which
are batch- and chunk-invariant, every run here is bit-identical."""

from __future__ import annotations

import json
from dataclasses import replace

import jsonschema

from chatmesh.finish import FinishReason
from engine.request import EngineRequest
from engine.structured import Constraint, GrammarCompiler
from tests.engine.core_helpers import Result, request
from tests.engine.test_engine_real_model import (  # noqa: F401 (fixtures)
    assert_same_tokens,
    chat,
    model_runner,
    real_engine,
)

SPECULATING = {"speculative_tokens": 4, "speculative_max_batch": 4}
PARAGRAPH = (
    "The lighthouse keeper climbs ninety-seven steps each evening, trims the wick, polishes the great "
    "lens and writes down the weather: wind from the west, a heavy swell, gulls flying low over the rocks."
)
CODE = (
    "def total(prices):\n"
    "    result = 0\n"
    "    for price in prices:\n"
    "        result = result + price\n"
    "    return result\n"
)


def run(runner, requests: list[EngineRequest], **config: object) -> tuple[dict[str, Result], object]:
    test = real_engine(runner, **config)
    for req in requests:
        test.engine.add_request(req)
    return test.run(), test


def logprobs_of(test, request_id: str) -> list:
    return [lp for o in test.outputs if o.request_id == request_id for lp in o.logprobs]


def test_input_grounded_answers_are_the_same_with_and_without_speculation(
    model_runner,  # noqa: F811
    chat,  # noqa: F811
    assert_same_tokens,  # noqa: F811
):
    repeat = chat(f"Repeat this text exactly, word for word:\n\n{PARAGRAPH}")
    edit = chat(f"Rename the variable result to acc in this code and show the whole code:\n\n{CODE}")
    reqs = [
        request("repeat", repeat, max_tokens=48, logprobs=True, top_logprobs=3),
        request("edit", edit, max_tokens=48),
        request("sampled", repeat, max_tokens=48, temperature=0.7, top_p=0.9, seed=21),
    ]
    together, test = run(model_runner, reqs, **SPECULATING)
    engine = test.engine
    assert engine.accepted_draft_tokens >= 20, "drafts taken from the input were accepted"
    for req in reqs:
        alone = run(model_runner, [req])[0]
        prompt = list(req.prompt_token_ids)
        assert_same_tokens(together[req.request_id].token_ids, alone[req.request_id].token_ids, prompt)
    # Alone with speculation too: the same answers, and its acceptance on a text it must repeat.
    alone_spec, spec_test = run(model_runner, [reqs[0]], **SPECULATING)
    assert alone_spec["repeat"].token_ids == together["repeat"].token_ids
    assert logprobs_of(spec_test, "repeat") == logprobs_of(run(model_runner, [reqs[0]])[1], "repeat")
    assert spec_test.engine.accepted_draft_tokens / spec_test.engine.draft_tokens > 0.5


def test_a_constrained_answer_is_the_same_with_and_without_speculation(
    model_runner,  # noqa: F811
    chat,  # noqa: F811
    chat_tokenizer,
    assert_same_tokens,  # noqa: F811
):
    """The grammar masks every verified position, as it advances over the accepted tokens only."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "job": {"type": "string"}},
        "required": ["name", "city", "job"],
        "additionalProperties": False,
    }
    constraint = Constraint("json_schema", json.dumps(schema))
    grammar = GrammarCompiler(chat_tokenizer).compile(constraint)
    ask = chat(
        "Extract the person as JSON with name, city and job: Margaret Oyelaran-Whitfield, a lighthouse "
        "keeper from Port Isaac in Cornwall, England."
    )
    reqs = [
        replace(request(rid, ask, max_tokens=48, constraint=constraint, **params), grammar=grammar)
        for rid, params in (("greedy", {}), ("seeded", {"temperature": 0.8, "seed": 5}))
    ]
    spec, test = run(model_runner, reqs, **SPECULATING)
    assert test.engine.accepted_draft_tokens > 0
    for req in reqs:
        plain = run(model_runner, [req])[0][req.request_id]
        assert_same_tokens(spec[req.request_id].token_ids, plain.token_ids, list(req.prompt_token_ids))
        assert spec[req.request_id].finish.reason == FinishReason.STOP
        jsonschema.validate(json.loads(spec[req.request_id].text), schema)
