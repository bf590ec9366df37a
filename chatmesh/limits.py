"""The limits every layer enforces, defined once, and the pure checks of a request against them.

``Limits`` is the one definition. Its fields with a ``help`` are the ones an operator sets, and the
orchestrator's flags are the one place to set them (``--max-message-bytes``, ``--max-model-chars``, ...,
derived from these fields): the orchestrator checks requests against them and hands them to
memory_store, and the edge leaves those checks to the orchestrator. The others are fixed by the API
(chat.proto) and every layer reads them from here. Each violation is INVALID_ARGUMENT naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import invalid, too_large


def _setting(default: int, help: str) -> Any:
    """A limit the operator sets (a field with help text becomes an orchestrator flag)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = _setting(32 * 1024, "largest user message (UTF-8 bytes)")
    max_model_chars: int = _setting(128, "longest model name a request may give")
    default_max_tokens: int = _setting(512, "answer length when a request sets none")
    max_tokens: int = _setting(4096, "largest max_tokens a request may ask for")
    # Fixed by the API.
    max_stop_sequences: int = 4
    max_stop_chars: int = 64
    max_title_chars: int = 200
    max_idempotency_key_chars: int = 128
    # Chat, message and run ids (server-chosen, URL-safe).
    max_id_chars: int = 128
    max_chat_page: int = 100
    default_chat_page: int = 20
    max_search_query_chars: int = 200
    max_search_page: int = 50
    default_search_page: int = 20
    max_message_page: int = 200
    default_message_page: int = 50
    # Complete: a caller-supplied conversation.
    max_prompt_messages: int = 1000

    def __post_init__(self) -> None:
        for name in ("max_message_bytes", "max_model_chars", "default_max_tokens", "max_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


# Sampling defaults when a request leaves them unset (the proto's "absent selects the default").
DEFAULT_TEMPERATURE = 0.7
# Bounds of the sampling knobs (OpenAI's: top_logprobs 0..20; logit_bias is bounded by us).
MAX_LOGIT_BIAS = 1024
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Generation:
    """How to generate one answer, validated and with defaults applied."""

    model: str
    max_tokens: int
    temperature: float
    # 0 disables nucleus sampling.
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    # What the answer must match (the engine checks and compiles it); None: free text.
    structured: engine_pb2.StructuredOutput | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    min_p: float = 0.0
    logprobs: bool = False
    top_logprobs: int = 0


def check_content(content: str, limits: Limits, field: str = "content", may_be_empty: bool = False) -> None:
    size = len(content.encode("utf-8"))
    if size > limits.max_message_bytes:
        raise too_large(
            field,
            f"{field} is {size} bytes of UTF-8; the limit is {limits.max_message_bytes}",
            f"{limits.max_message_bytes} bytes",
        )
    if not content.strip() and not may_be_empty:
        raise invalid(field, f"{field} must not be empty")


def generation(
    options: chat_pb2.GenerationOptions, limits: Limits, default_model: str, vocab_size: int | None = None
) -> Generation:
    """``options`` checked and with defaults applied; ``vocab_size``: the served tokenizer's, which
    ``logit_bias`` token ids must be within (None: left to the engine)."""
    if len(options.model) > limits.max_model_chars:
        raise invalid("options.model", f"model names have at most {limits.max_model_chars} characters")
    max_tokens = options.max_tokens or limits.default_max_tokens
    if max_tokens > limits.max_tokens:
        raise invalid("options.max_tokens", f"max_tokens is {max_tokens}; the limit is {limits.max_tokens}")
    temperature = options.temperature if options.HasField("temperature") else DEFAULT_TEMPERATURE
    if not (math.isfinite(temperature) and 0.0 <= temperature <= 2.0):
        raise invalid("options.temperature", "temperature must be in [0, 2]")
    top_p = options.top_p if options.HasField("top_p") else 0.0
    if options.HasField("top_p") and not (math.isfinite(top_p) and 0.0 < top_p <= 1.0):
        raise invalid("options.top_p", "top_p must be in (0, 1]")
    if len(options.stop) > limits.max_stop_sequences:
        raise invalid("options.stop", f"at most {limits.max_stop_sequences} stop sequences")
    for stop in options.stop:
        if not 1 <= len(stop) <= limits.max_stop_chars:
            raise invalid("options.stop", f"stop sequences have 1..{limits.max_stop_chars} characters")
    for knob in ("presence_penalty", "frequency_penalty"):
        value = getattr(options, knob)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise invalid(f"options.{knob}", f"{knob} must be in [-2, 2]")
    if not (math.isfinite(options.min_p) and 0.0 <= options.min_p <= 1.0):
        raise invalid("options.min_p", "min_p must be in [0, 1]")
    if len(options.logit_bias) > MAX_LOGIT_BIAS:
        raise invalid("options.logit_bias", f"logit_bias has at most {MAX_LOGIT_BIAS} entries")
    if not all(math.isfinite(bias) and -100.0 <= bias <= 100.0 for bias in options.logit_bias.values()):
        raise invalid("options.logit_bias", "logit_bias values must be in [-100, 100]")
    if vocab_size is not None and options.logit_bias and max(options.logit_bias) >= vocab_size:
        raise invalid(
            "options.logit_bias",
            f"logit_bias names token id {max(options.logit_bias)}, beyond the vocabulary of {vocab_size}",
        )
    if options.top_logprobs > MAX_TOP_LOGPROBS:
        raise invalid("options.top_logprobs", f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}")
    if options.top_logprobs and not options.logprobs:
        raise invalid("options.top_logprobs", "top_logprobs needs logprobs")
    return Generation(
        model=options.model or default_model,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=0.0 if top_p == 1.0 else top_p,
        seed=options.seed if options.HasField("seed") else None,
        stop=tuple(options.stop),
        structured=_structured(options.structured) if options.HasField("structured") else None,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        logit_bias=tuple(sorted(options.logit_bias.items())),
        min_p=options.min_p,
        logprobs=options.logprobs,
        top_logprobs=options.top_logprobs,
    )


def _structured(public: chat_pb2.StructuredOutput) -> engine_pb2.StructuredOutput:
    """The public API's constraint as the engine's message (the same oneof, field for field)."""
    kind = public.WhichOneof("kind")
    if kind is None:
        raise invalid("options.structured", "options.structured names no constraint")
    if kind == "choice":
        return engine_pb2.StructuredOutput(choice=engine_pb2.Choices(choices=public.choice.choices))
    return engine_pb2.StructuredOutput(**{kind: getattr(public, kind)})


def page_size(requested: int, default: int, maximum: int) -> int:
    if requested > maximum:
        raise invalid("page_size", f"page_size must be 1..{maximum} (0 selects {default})")
    return requested or default


def check_title(title: str, limits: Limits, allow_empty: bool) -> None:
    low = 0 if allow_empty else 1
    if not low <= len(title) <= limits.max_title_chars:
        raise invalid("title", f"title must have {low}..{limits.max_title_chars} characters")


def check_search_query(query: str, limits: Limits) -> None:
    if not query.strip() or len(query) > limits.max_search_query_chars:
        raise invalid("query", f"a search query must have 1..{limits.max_search_query_chars} characters")


def check_idempotency_key(key: str, limits: Limits) -> None:
    if len(key) > limits.max_idempotency_key_chars:
        raise invalid(
            "idempotency_key",
            f"idempotency_key has at most {limits.max_idempotency_key_chars} characters",
        )


def check_id(value: str, field: str) -> None:
    if not value:
        raise invalid(field, f"{field} is required")
