"""Request limits and generation defaults (pure logic, no services)."""

from __future__ import annotations

import pytest

from chatmesh.chat.v1 import chat_pb2
from chatmesh.errors import ServiceError
from chatmesh.identity import Identity
from chatmesh.limits import DEFAULT_TEMPERATURE, Limits, check_content, generation, page_size
from orchestrator import config as configuration
from orchestrator.policy.admission import RunSlots, check_model_budgets

LIMITS = Limits()


def test_unset_options_take_the_defaults_and_an_empty_model_the_default_model() -> None:
    gen = generation(chat_pb2.GenerationOptions(), LIMITS, "SmolLM2")
    assert (gen.model, gen.max_tokens, gen.temperature, gen.top_p, gen.seed, gen.stop) == (
        "SmolLM2",
        LIMITS.default_max_tokens,
        DEFAULT_TEMPERATURE,
        0.0,
        None,
        (),
    )
    explicit = generation(
        chat_pb2.GenerationOptions(model="m", max_tokens=5, temperature=0.0, top_p=1.0, seed=7, stop=["x"]),
        LIMITS,
        "SmolLM2",
    )
    assert (explicit.model, explicit.max_tokens, explicit.temperature, explicit.seed) == ("m", 5, 0.0, 7)
    assert explicit.top_p == 0.0  # 1.0 keeps every token: nucleus sampling off


@pytest.mark.parametrize(
    ("options", "field"),
    [
        (chat_pb2.GenerationOptions(max_tokens=LIMITS.max_tokens + 1), "options.max_tokens"),
        (chat_pb2.GenerationOptions(temperature=2.5), "options.temperature"),
        (chat_pb2.GenerationOptions(top_p=0.0), "options.top_p"),
        (chat_pb2.GenerationOptions(stop=["a", "b", "c", "d", "e"]), "options.stop"),
        (chat_pb2.GenerationOptions(stop=[""]), "options.stop"),
        (chat_pb2.GenerationOptions(model="m" * 200), "options.model"),
        (chat_pb2.GenerationOptions(presence_penalty=2.01), "options.presence_penalty"),
        (chat_pb2.GenerationOptions(frequency_penalty=float("inf")), "options.frequency_penalty"),
        (chat_pb2.GenerationOptions(min_p=-0.1), "options.min_p"),
        (chat_pb2.GenerationOptions(logit_bias={5: 100.5}), "options.logit_bias"),
        (chat_pb2.GenerationOptions(logit_bias={i: 1.0 for i in range(1025)}), "options.logit_bias"),
        (chat_pb2.GenerationOptions(logprobs=True, top_logprobs=21), "options.top_logprobs"),
        (chat_pb2.GenerationOptions(top_logprobs=2), "options.top_logprobs"),
    ],
)
def test_each_bad_option_is_refused_naming_its_field(options: chat_pb2.GenerationOptions, field: str) -> None:
    with pytest.raises(ServiceError) as caught:
        generation(options, LIMITS, "SmolLM2")
    assert caught.value.code.name == "INVALID_ARGUMENT" and caught.value.field == field


def test_the_sampling_knobs_carry_over_with_the_bias_sorted_by_token() -> None:
    gen = generation(
        chat_pb2.GenerationOptions(
            presence_penalty=-0.5,
            frequency_penalty=1.5,
            logit_bias={9: -3.0, 2: 4.0},
            min_p=0.1,
            logprobs=True,
            top_logprobs=3,
        ),
        LIMITS,
        "SmolLM2",
    )
    assert (gen.presence_penalty, gen.frequency_penalty, gen.min_p) == pytest.approx((-0.5, 1.5, 0.1))
    assert gen.logit_bias == ((2, 4.0), (9, -3.0)) and (gen.logprobs, gen.top_logprobs) == (True, 3)


def test_a_logit_bias_beyond_the_served_vocabulary_is_refused() -> None:
    options = chat_pb2.GenerationOptions(logit_bias={99: 1.0})
    assert generation(options, LIMITS, "SmolLM2", vocab_size=100).logit_bias == ((99, 1.0),)
    with pytest.raises(ServiceError) as caught:
        generation(chat_pb2.GenerationOptions(logit_bias={100: 1.0}), LIMITS, "SmolLM2", vocab_size=100)
    assert caught.value.field == "options.logit_bias" and "vocabulary of 100" in caught.value.message


def test_message_size_is_counted_in_utf8_bytes_and_marked_too_large() -> None:
    check_content("é" * (LIMITS.max_message_bytes // 2), LIMITS)
    with pytest.raises(ServiceError) as caught:
        check_content("é" * (LIMITS.max_message_bytes // 2 + 1), LIMITS)
    assert caught.value.too_large == f"{LIMITS.max_message_bytes} bytes" and caught.value.field == "content"


def test_page_sizes_default_and_are_bounded() -> None:
    assert page_size(0, 20, 100) == 20 and page_size(100, 20, 100) == 100
    with pytest.raises(ServiceError):
        page_size(101, 20, 100)


def test_concurrent_runs_are_bounded_per_user_by_tier() -> None:
    slots = RunSlots({"free": 1, "pro": 2, "enterprise": 4})
    alice, bob = Identity("alice", "free"), Identity("bob", "pro")
    slots.acquire(alice, "SmolLM2")
    with pytest.raises(ServiceError) as caught:
        slots.acquire(alice, "SmolLM2")
    assert caught.value.code.name == "RESOURCE_EXHAUSTED" and caught.value.retry_after_s
    slots.acquire(bob, "SmolLM2")
    slots.acquire(bob, "SmolLM2")
    slots.release("alice")
    slots.acquire(alice, "SmolLM2")


def test_a_model_budget_is_model_tier_and_tokens_and_names_a_served_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = configuration.parse(
        ["--model-budget", "gemma:free=1000", "--model-budget", "name:with:colons:pro=0"]
    )[1].budgets
    assert config.per_model == (("gemma", "free", 1000), ("name:with:colons", "pro", 0))
    check_model_budgets(config, ["gemma", "name:with:colons"])
    with pytest.raises(ValueError, match="names gemma, not served"):
        check_model_budgets(config, ["name:with:colons", "SmolLM2"])
    wrong = ["gemma=1000"], ["gemma:gold=1000"], ["gemma:free=-1"], [":free=5"], ["gemma:free=many"]
    twice = ["gemma:free=1", "gemma:free=2"]
    for flags, problem in [*((w, "MODEL:TIER=TOKENS") for w in wrong), (twice, "each model and tier once")]:
        with pytest.raises(SystemExit) as exit_:
            configuration.parse([arg for flag in flags for arg in ("--model-budget", flag)])
        assert exit_.value.code == 2 and problem in capsys.readouterr().err
