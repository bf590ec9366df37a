"""Turns a ``GenerateStart`` frame into an ``EngineRequest``, or says exactly what is wrong with it."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass

import grpc

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError
from chatmesh.tiers import engine_priority
from engine.request import EngineRequest, Priority, SamplingParams
from engine.structured import MAX_CONSTRAINT_CHARS, Constraint

# Bounds on what one request may ask for; beyond them the request is refused, not truncated.
MAX_REQUEST_ID_CHARS = 256
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 256
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
# The sampling knobs beyond temperature, top-p and top-k, by their SamplingParams field: what a backend
# that cannot apply them refuses rather than ignores.
EXTRA_KNOBS = ("presence_penalty", "frequency_penalty", "logit_bias", "min_p", "logprobs", "top_logprobs")


@dataclass(frozen=True)
class ServedModel:
    """What requests are checked against."""

    name: str
    tokenizer_fingerprint: str
    vocab_size: int
    context_length: int
    # Whether the engine applies EXTRA_KNOBS (our own sampler does; a hosted backend's may not).
    serves_extra_knobs: bool = True


def _invalid(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, message)


def request_from_proto(start: engine_pb2.GenerateStart, model: ServedModel) -> EngineRequest:
    if start.model and start.model != model.name:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this engine serves {model.name!r}, not {start.model!r}",
        )
    if start.tokenizer_fingerprint and start.tokenizer_fingerprint != model.tokenizer_fingerprint:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"the prompt was tokenized with {start.tokenizer_fingerprint!r}, but this engine's tokenizer is "
            f"{model.tokenizer_fingerprint!r}: re-tokenize with the engine's model",
        )
    if not start.request_id or len(start.request_id) > MAX_REQUEST_ID_CHARS:
        raise _invalid(f"request_id must have 1 to {MAX_REQUEST_ID_CHARS} characters")
    if not start.prompt_token_ids:
        raise _invalid("prompt_token_ids must not be empty")
    for name, ids in (
        ("prompt_token_ids", start.prompt_token_ids),
        ("resumed_output_token_ids", start.resumed_output_token_ids),
    ):
        if ids and max(ids) >= model.vocab_size:
            raise _invalid(f"{name} holds token id {max(ids)}, beyond the vocabulary of {model.vocab_size}")
    priority = engine_priority(start.priority)
    if priority is None:
        raise _invalid(f"unknown priority {start.priority}")
    sampling = _sampling_from_proto(start.sampling, model)
    if len(start.resumed_output_token_ids) > sampling.max_tokens:
        raise _invalid(
            f"{len(start.resumed_output_token_ids)} resumed output tokens exceed max_tokens={sampling.max_tokens}"
        )
    if len(start.prompt_token_ids) + sampling.max_tokens > model.context_length:
        raise _invalid(
            f"prompt ({len(start.prompt_token_ids)} tokens) + max_tokens ({sampling.max_tokens}) exceeds the "
            f"context window of {model.context_length} tokens"
        )
    return EngineRequest(
        request_id=start.request_id,
        prompt_token_ids=tuple(start.prompt_token_ids),
        sampling=sampling,
        resumed_output_token_ids=tuple(start.resumed_output_token_ids),
        priority=Priority(priority),  # Priority values are engine.v1 Priority values
        max_queue_s=start.max_queue_ms / 1000,
    )


def _sampling_from_proto(params: engine_pb2.SamplingParams, model: ServedModel) -> SamplingParams:
    if params.max_tokens <= 0:
        raise _invalid("sampling.max_tokens must be > 0")
    if not (math.isfinite(params.temperature) and 0.0 <= params.temperature <= 2.0):
        raise _invalid(f"sampling.temperature must be in [0, 2], got {params.temperature}")
    if not (math.isfinite(params.top_p) and 0.0 <= params.top_p <= 1.0):
        raise _invalid(f"sampling.top_p must be in [0, 1] (0 or 1: off), got {params.top_p}")
    if len(params.stop) > MAX_STOP_STRINGS:
        raise _invalid(f"at most {MAX_STOP_STRINGS} stop strings, got {len(params.stop)}")
    if any(not s or len(s) > MAX_STOP_STRING_CHARS for s in params.stop):
        raise _invalid(f"stop strings must have 1 to {MAX_STOP_STRING_CHARS} characters")
    if len(params.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise _invalid(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(params.stop_token_ids)}")
    if params.stop_token_ids and max(params.stop_token_ids) >= model.vocab_size:
        raise _invalid(f"stop token id {max(params.stop_token_ids)} is beyond the vocabulary")
    _check_extra_knobs(params, model)
    return SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p if 0.0 < params.top_p < 1.0 else 1.0,
        top_k=params.top_k if params.top_k < model.vocab_size else 0,
        # Unseeded requests still get a fixed seed, so their draws are reproducible within the request.
        seed=params.seed if params.HasField("seed") else secrets.randbits(64),
        max_tokens=params.max_tokens,
        stop=tuple(params.stop),
        stop_token_ids=frozenset(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        constraint=_constraint_from_proto(params.structured) if params.HasField("structured") else None,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        logit_bias=tuple(sorted(params.logit_bias.items())),
        min_p=params.min_p,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs if params.logprobs else 0,
    )


def _constraint_from_proto(structured: engine_pb2.StructuredOutput) -> Constraint:
    """What the output must match, checked for shape (whether it compiles is the service's check)."""
    kind = structured.WhichOneof("kind")
    if kind is None:
        raise _invalid("sampling.structured names no constraint")
    if kind == "json_object":
        if not structured.json_object:
            raise _invalid("sampling.structured.json_object must be true (or the constraint absent)")
        return Constraint("json_object")
    if kind == "choice":
        choices = list(structured.choice.choices)
        if not choices or len(choices) > MAX_CHOICES or not all(choices):
            raise _invalid(f"sampling.structured.choice must hold 1 to {MAX_CHOICES} non-empty strings")
        spec = json.dumps(choices)
    else:
        spec = getattr(structured, kind)
        if not spec:
            raise _invalid(f"sampling.structured.{kind} must not be empty")
    if len(spec) > MAX_CONSTRAINT_CHARS:
        raise _invalid(
            f"sampling.structured.{kind} has {len(spec)} characters; the limit is {MAX_CONSTRAINT_CHARS}"
        )
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as exc:
            raise _invalid(f"sampling.structured.json_schema is not JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _invalid("sampling.structured.json_schema must be a JSON object")
    return Constraint(kind, spec)


def _check_extra_knobs(params: engine_pb2.SamplingParams, model: ServedModel) -> None:
    if not model.serves_extra_knobs:
        for knob in EXTRA_KNOBS:
            if getattr(params, knob):
                raise _invalid(f"sampling.{knob} is not served by this engine's backend")
    for knob in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, knob)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise _invalid(f"sampling.{knob} must be in [-2, 2], got {value}")
    if not (math.isfinite(params.min_p) and 0.0 <= params.min_p <= 1.0):
        raise _invalid(f"sampling.min_p must be in [0, 1], got {params.min_p}")
    if params.top_logprobs > MAX_TOP_LOGPROBS:
        raise _invalid(f"sampling.top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {params.top_logprobs}")
    if len(params.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid(f"at most {MAX_LOGIT_BIAS_ENTRIES} logit_bias entries, got {len(params.logit_bias)}")
    for token, bias in params.logit_bias.items():
        if token >= model.vocab_size:
            raise _invalid(f"logit_bias token id {token} is beyond the vocabulary of {model.vocab_size}")
        if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
            raise _invalid(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
