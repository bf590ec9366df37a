"""Constrained decoding (engine.structured) on the real model, driven step by step: outputs that match
their constraint, batched with free text without changing anyone's tokens, resumed exactly, cut by
max_tokens with LENGTH; and the compiler's refusals and cache."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from chatmesh.finish import FinishReason
from chatmesh.tokenizer import ChatMessage
from engine.request import EngineRequest
from engine.structured import LOOP_NGRAM, Constraint, GrammarCompiler, allowed_tokens
from tests.engine.core_helpers import make_engine, request
from tests.engine.test_engine_real_model import model_runner  # noqa: F401 (the fixture)

SCHEMAS = Path(__file__).resolve().parent.parent / "data" / "json_schemas"


@pytest.fixture(scope="module")
def compiler(chat_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(chat_tokenizer)


def schema(name: str) -> dict:
    return json.loads((SCHEMAS / f"{name}.json").read_text())


def asking(chat_tokenizer, body: dict) -> list[int]:
    """The prompt the benchmark sends too: the schema in the system turn, its description as the ask."""
    system = "Answer with JSON that follows this schema: " + json.dumps(body)
    return chat_tokenizer.encode_chat(
        [ChatMessage("system", system), ChatMessage("user", body["description"])]
    )


def constrained(compiler, rid: str, prompt: list[int], constraint: Constraint, **params) -> EngineRequest:
    base = request(rid, prompt, constraint=constraint, **params)
    return replace(base, grammar=compiler.compile(constraint))


def run(model_runner, *requests: EngineRequest, **config):  # noqa: F811
    settings = {"block_size": 16, "num_kv_blocks": 256, "max_batched_tokens": 128, "max_running_requests": 16}
    test = make_engine(model_runner, **{**settings, **config})
    for req in requests:
        test.engine.add_request(req)
    return test.run()


NAMES = ("person", "order", "event", "sentiment")


def test_constrained_outputs_validate_and_batch_with_free_text_without_changing_any_tokens(
    model_runner,  # noqa: F811
    compiler,
    chat_tokenizer,
):
    asks = {
        name: constrained(compiler, name, asking(chat_tokenizer, schema(name)), _json(name), max_tokens=96)
        for name in NAMES
    }
    free = request("free", chat_tokenizer.encode_chat([ChatMessage("user", "Name a fruit.")]), max_tokens=24)
    together = run(model_runner, *asks.values(), free)
    for name in NAMES:
        done = together[name]
        assert done.finish.reason == FinishReason.STOP, f"{name}: {done.text!r}"
        jsonschema.validate(json.loads(done.text), schema(name))
        assert run(model_runner, asks[name])[name].token_ids == done.token_ids, f"{name}: batch-invariant"
    alone = run(model_runner, free)["free"]
    assert alone.token_ids == together["free"].token_ids, "free text beside constrained rows is unchanged"
    assert not alone.text.startswith("{")


def test_seeded_sampling_under_a_constraint_is_a_function_of_seed_and_position(
    model_runner,  # noqa: F811
    compiler,
    chat_tokenizer,
):
    prompt = asking(chat_tokenizer, schema("book"))
    runs = [
        constrained(compiler, rid, prompt, _json("book"), max_tokens=48, temperature=1.0, seed=seed)
        for rid, seed in (("a", 11), ("b", 11), ("c", 12))
    ]
    done = run(model_runner, *runs)
    assert done["a"].token_ids == done["b"].token_ids, "same seed, same tokens, side by side"
    assert done["a"].token_ids != done["c"].token_ids
    assert run(model_runner, runs[0])["a"].token_ids == done["a"].token_ids, "alone as in the batch"
    assert done["a"].text.startswith('{"title": ')


def test_a_resumed_constrained_request_continues_as_the_uninterrupted_one(
    model_runner,  # noqa: F811
    compiler,
    chat_tokenizer,
):
    """A run adopted after its replica died starts again with its output so far: the grammar is advanced
    past it, and the rest is what the uninterrupted run produced."""
    prompt = asking(chat_tokenizer, schema("company"))
    whole = run(model_runner, constrained(compiler, "whole", prompt, _json("company"), max_tokens=96))[
        "whole"
    ]
    assert whole.finish.reason == FinishReason.STOP
    cut = 9
    resumed = constrained(
        compiler, "again", prompt, _json("company"), max_tokens=96, resumed=tuple(whole.token_ids[:cut])
    )
    again = run(model_runner, resumed)["again"]
    assert again.token_ids == whole.token_ids[cut:], "the same continuation"
    jsonschema.validate(
        json.loads(chat_tokenizer.decode(whole.token_ids[:cut]) + again.text), schema("company")
    )


def test_max_tokens_cuts_a_constrained_output_with_length(model_runner, compiler, chat_tokenizer):  # noqa: F811
    prompt = asking(chat_tokenizer, schema("order"))
    done = run(model_runner, constrained(compiler, "cut", prompt, _json("order"), max_tokens=6))["cut"]
    assert done.finish.reason == FinishReason.LENGTH and len(done.token_ids) == 6
    assert done.text.startswith('{"order_id": ')


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        (Constraint("regex", r"(yes|no), because [a-z ]{1,30}\."), r"^(yes|no), because [a-z ]{1,30}\.$"),
        (Constraint("choice", json.dumps(["Paris", "London", "Rome"])), r"^(Paris|London|Rome)$"),
        (Constraint("json_object"), r"^\{.*\}$"),
        (
            Constraint("grammar", 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'),
            r"^The answer is \d+\.$",
        ),
    ],
    ids=["regex", "choice", "json_object", "grammar"],
)
def test_regex_choice_json_object_and_grammar_constraints_hold(
    model_runner,  # noqa: F811
    compiler,
    chat_tokenizer,
    constraint,
    check,
):
    import re

    prompt = chat_tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    done = run(model_runner, constrained(compiler, "c", prompt, constraint, max_tokens=64))["c"]
    assert done.finish.reason == FinishReason.STOP
    assert re.match(check, done.text, re.DOTALL), done.text
    if constraint.kind == "json_object":
        assert isinstance(json.loads(done.text), dict)


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        (
            Constraint("json_schema", json.dumps({"type": "string", "format": "no-such-format"})),
            "no-such-format",
        ),
        (Constraint("json_schema", json.dumps({"$ref": "#/definitions/missing"})), "missing"),
        (Constraint("regex", "[a-"), "unclosed character class"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
    ids=["unknown format", "dangling $ref", "bad regex", "bad grammar"],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_the_problem(compiler, constraint, problem):
    with pytest.raises(ValueError, match="invalid") as refused:
        compiler.compile(constraint)
    assert problem in str(refused.value)
    assert compiler.cached(constraint) is None


def test_a_compiled_constraint_is_kept_per_distinct_constraint(compiler):
    first = compiler.compile(_json("point"))
    assert compiler.cached(_json("point")) is first and compiler.compile(_json("point")) is first
    assert compiler.compile(_json("color")) is not first


def _json(name: str) -> Constraint:
    return Constraint("json_schema", json.dumps(schema(name)))


def test_masks_leave_free_rows_and_the_runners_buffer_alone_and_skip_greedy_rows_whose_best_is_allowed(
    compiler, chat_tokenizer
):
    import numpy as np

    from engine.structured import allowed_tokens, constrained_logits

    grammar = compiler.compile(Constraint("choice", json.dumps(["yes", "no"])))
    states = [grammar.start(), grammar.start()]
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((4, chat_tokenizer.vocab_size + 8), dtype=np.float32)  # 8 padding tokens
    allowed = allowed_tokens(states, logits.shape[1])
    assert not allowed[:, chat_tokenizer.vocab_size :].any(), "padding tokens are never allowed"
    yes = chat_tokenizer.encode("yes")[0]
    assert allowed[0, yes] and allowed.sum(axis=1).tolist() == [allowed[0].sum()] * 2
    logits[1, yes] = 100.0  # row 1's best token is allowed: greedy, it needs no masking
    argmax = np.argmax(logits, axis=1)
    before = logits.copy()
    out, best = constrained_logits(logits, argmax, [1, 3], states, [True, True])
    assert np.array_equal(logits, before) and best is not argmax, "the runner's arrays are not written"
    assert np.array_equal(out[[0, 2]], before[[0, 2]]), "free rows unchanged"
    assert np.array_equal(out[1], before[1]) and best[1] == yes, "an allowed best token: left as it is"
    assert np.isinf(out[3][~allowed[1]]).all() and np.array_equal(out[3][allowed[1]], before[3][allowed[1]])
    assert allowed[1, best[3]] and best[3] == np.argmax(out[3])
    sampled, _ = constrained_logits(logits, argmax, [1, 3], states, [False, False])
    assert np.isinf(sampled[1][~allowed[0]]).all(), "a sampled row is always masked"


class _RunnerThatKnowsArgmax:
    """The real runner, telling the engine each row's argmax as a GPU runner that picks on the device
    does: the engine then skips masking a greedy row whose argmax its grammar allows."""

    def __init__(self, runner) -> None:
        self._runner = runner
        self._logits = None

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def execute(self, chunks):
        self._logits = self._runner.execute(chunks)
        return self._logits

    def argmax(self):
        import numpy as np

        return np.argmax(self._logits, axis=1)


def test_a_greedy_constrained_row_whose_logits_the_sampler_changes_still_keeps_to_its_grammar(
    model_runner,  # noqa: F811
    compiler,
    chat_tokenizer,
):
    runner = _RunnerThatKnowsArgmax(model_runner)
    (one,) = chat_tokenizer.encode("1")
    prompt = chat_tokenizer.encode_chat([ChatMessage("user", "What is the capital of France?")])
    biased = {"max_tokens": 6, "logit_bias": ((one, 100.0),)}
    free = run(runner, request("free", prompt, **biased))["free"]
    assert free.text.startswith("1"), "the bias alone picks the digit"
    no_digits = Constraint("regex", "[^0-9]*")
    done = run(runner, constrained(compiler, "c", prompt, no_digits, **biased))["c"]
    assert done.text and not any(ch.isdigit() for ch in done.text), done.text


TWO_STRINGS = Constraint(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"a": {"type": "string"}, "b": {"type": "string"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        }
    ),
)
PHRASE = " the cat sat on the mat and"


def allowed_after(compiler, chat_tokenizer, text: str):
    state = compiler.compile(TWO_STRINGS).start(chat_tokenizer.encode(text))
    return allowed_tokens([state], chat_tokenizer.vocab_size)[0]


def closes_a_string(chat_tokenizer, token: int) -> bool:
    return b'"' in chat_tokenizer.token_bytes(token).replace(b'\\"', b"")


def test_a_json_string_that_repeats_itself_verbatim_is_ended_there(compiler, chat_tokenizer):
    assert 2 * len(chat_tokenizer.encode(PHRASE)) > LOOP_NGRAM  # three times the phrase is a loop
    looping = allowed_after(compiler, chat_tokenizer, '{"a": "' + PHRASE * 3)
    assert looping.any() and all(closes_a_string(chat_tokenizer, t) for t in looping.nonzero()[0])
    # Said once, or twice short of a loop, the string goes on freely.
    for text in ('{"a": "' + PHRASE, '{"a": "' + PHRASE + " the cat"):
        free = allowed_after(compiler, chat_tokenizer, text)
        assert not all(closes_a_string(chat_tokenizer, t) for t in free.nonzero()[0])
    # Another field copying a value is no loop: each string counts its own tokens.
    copied = allowed_after(compiler, chat_tokenizer, '{"a": "' + PHRASE * 2 + '", "b": "' + PHRASE * 1)
    assert not all(closes_a_string(chat_tokenizer, t) for t in copied.nonzero()[0])
    # An escaped quote does not end the string it is in.
    escaped = allowed_after(compiler, chat_tokenizer, '{"a": "say \\"hi\\"' + PHRASE * 3)
    assert all(closes_a_string(chat_tokenizer, t) for t in escaped.nonzero()[0])


def test_a_looping_string_that_may_not_end_yet_goes_on(compiler, chat_tokenizer):
    at_least = Constraint(
        "json_schema",
        json.dumps({"type": "object", "properties": {"a": {"type": "string", "minLength": 400}}}),
    )
    state = compiler.compile(at_least).start(chat_tokenizer.encode('{"a": "' + PHRASE * 3))
    allowed = allowed_tokens([state], chat_tokenizer.vocab_size)[0]
    assert allowed.any() and not any(closes_a_string(chat_tokenizer, t) for t in allowed.nonzero()[0])
