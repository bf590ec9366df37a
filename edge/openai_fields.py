"""The OpenAI fields chatmesh knows but does not implement, and the values of each it takes as no-ops.

OpenAI's SDKs and the frameworks over them send fields at values that ask for nothing (``store: false``,
``user``, ``modalities: ["text"]``); refusing those would break real clients. Any other value asks for something chatmesh would not do, so it is refused naming the
field (400 ``unsupported_value``), never ignored; a field neither in a body's model nor in its table here
is refused as OpenAI refuses it (the model's ``extra="forbid"``: 400 naming it). ``null`` is "not given"
for every field here.

This table is the one place to edit when a feature lands: implementing a field means declaring it in its
model (edge/schemas.py) and deleting its row here.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, get_args

from pydantic import BaseModel
from starlette.datastructures import QueryParams

from edge.errors import ApiError
from edge.schemas import (
    ChatCompletionIn,
    ChatMessageIn,
    CompletionIn,
    FunctionCallItemIn,
    FunctionCallOutputItemIn,
    ResponseCreateIn,
    StreamOptionsIn,
    TextPart,
)

# Accepts every value: the field asks nothing of the answer (an end-user id, a cache-routing hint).
ANY = None


@dataclass(frozen=True)
class NoOp:
    """A known field chatmesh does not implement: ``values`` are those that ask for nothing (``ANY``:
    all do); ``missing`` says what chatmesh does not do, for the refusal of any other value."""

    values: tuple[Any, ...] | None
    missing: str


_FUNCTIONS = "the deprecated functions API is not served: give tools (docs/structured-outputs.md)"
_NO_STORE = "completions are not stored for distillation or evals"
_TEXT_ONLY = "text is the only output"
_NO_REASONING = "the served models do not reason in hidden tokens"
_ONE_CHOICE = "one choice per request is generated on /v1/completions (n is served on chat completions)"

# Fields of an assistant message that the SDKs echo back as null or empty when a caller appends the
# previous answer to `messages`, and the Responses API's message item fields.
_MESSAGE: dict[str, NoOp] = {
    "type": NoOp(("message",), "input items other than messages and function calls are not served"),
    "id": NoOp(ANY, "an item id is only echoed"),
    "status": NoOp(("completed", "incomplete", "in_progress"), "an item status is only echoed"),
    "name": NoOp(ANY, "participant names are not part of the prompt"),
    "refusal": NoOp((), "an assistant message carries its refusal as content"),
    "function_call": NoOp((), _FUNCTIONS),
    "audio": NoOp((), _TEXT_ONLY),
    "annotations": NoOp(([],), "annotations are not served"),
}

_ECHOED_ITEM: dict[str, NoOp] = {
    "id": _MESSAGE["id"],
    "status": _MESSAGE["status"],
}

NO_OPS: dict[type[BaseModel], dict[str, NoOp]] = {
    ChatCompletionIn: {
        "user": NoOp(ANY, "callers are identified by their token"),
        "safety_identifier": NoOp(ANY, "callers are identified by their token"),
        "prompt_cache_key": NoOp(ANY, "prompt caching is automatic"),
        "metadata": NoOp(ANY, "metadata is kept with stored completions only"),
        "store": NoOp((False,), _NO_STORE),
        "service_tier": NoOp(("auto", "default"), "the service tier comes from the caller's token"),
        "functions": NoOp(([],), _FUNCTIONS),
        "function_call": NoOp(("none", "auto"), _FUNCTIONS),
        "modalities": NoOp((["text"],), _TEXT_ONLY),
        "audio": NoOp((), _TEXT_ONLY),
        "prediction": NoOp((), "predicted outputs are not served"),
        "reasoning_effort": NoOp((), _NO_REASONING),
        "verbosity": NoOp(("medium",), "verbosity is not served"),
        "web_search_options": NoOp((), "web search is not served"),
    },
    CompletionIn: {
        "n": NoOp((1,), _ONE_CHOICE),
        "best_of": NoOp((1,), _ONE_CHOICE),
        "echo": NoOp((False,), "the prompt is not echoed back"),
        "suffix": NoOp((), "insertion (text after the completion) is not served"),
        "user": NoOp(ANY, "callers are identified by their token"),
    },
    StreamOptionsIn: {
        # OpenAI pads chunks against a length side channel by default; chatmesh sends no padding either way.
        "include_obfuscation": NoOp((True, False), "chunks carry no obfuscation padding"),
    },
    ChatMessageIn: _MESSAGE,
    # The Responses API's function call items, as the SDKs give an earlier answer's output back.
    FunctionCallItemIn: _ECHOED_ITEM,
    FunctionCallOutputItemIn: _ECHOED_ITEM,
    TextPart: {
        "annotations": NoOp(([],), "annotations are not served"),
        "logprobs": NoOp(([],), "logprobs are only echoed back in input items"),
    },
    ResponseCreateIn: {
        "max_tool_calls": NoOp(
            (), "a cap on tool calls is not served (parallel_tool_calls: false allows one)"
        ),
        "top_logprobs": NoOp((0,), "logprobs are served on Chat Completions only"),
        "include": NoOp(([],), "no extra output data is served"),
        "reasoning": NoOp(({},), _NO_REASONING),
        "truncation": NoOp(("disabled",), "over-long input is refused, not truncated"),
        "user": NoOp(ANY, "callers are identified by their token"),
        "safety_identifier": NoOp(ANY, "callers are identified by their token"),
        "prompt_cache_key": NoOp(ANY, "prompt caching is automatic"),
        "metadata": NoOp(({},), "response metadata is not stored yet"),
        "service_tier": NoOp(("auto", "default"), "the service tier comes from the caller's token"),
        "stream_options": NoOp(({"include_obfuscation": True}, {"include_obfuscation": False}), "no padding"),
        "prompt": NoOp((), "stored prompt templates are not served"),
    },
}


# Query parameters of ``GET /v1/responses/{id}`` that are known but not served (``stream`` and
# ``starting_after`` are served).
RETRIEVE_QUERY_NO_OPS: dict[str, NoOp] = {
    "include_obfuscation": NoOp(("true", "false"), "streams carry no obfuscation padding"),
    "include[]": NoOp((), "no extra output data is served"),
}


def check_query(
    query: QueryParams, served: Collection[str] = (), no_ops: Mapping[str, NoOp] | None = None
) -> None:
    """Refuses a query parameter that is neither ``served`` nor at a no-op value, naming it (400)."""
    for name, value in query.multi_items():
        if name in served:
            continue
        if no_ops is not None and name in no_ops:
            _check(no_ops[name], value, name)
            continue
        raise ApiError(
            400, f"Unrecognized request argument supplied: {name}", code="unknown_parameter", param=name
        )


def without_no_ops(model: type[BaseModel], body: dict) -> dict:
    """``body`` (for ``model``) with every field at a no-op value taken out, at any depth; 400 naming
    the first field at a value chatmesh does not serve. Unknown fields are left for the model to refuse."""
    return _strip(model, body, "")


def _strip(model: type[BaseModel], body: dict, path: str) -> dict:
    table = NO_OPS.get(model, {})
    kept: dict = {}
    for name, value in body.items():
        param = f"{path}.{name}" if path else name
        if name in model.model_fields:
            kept[name] = _strip_nested(model.model_fields[name].annotation, value, param)
        elif name in table:
            _check(table[name], value, param)
        else:
            kept[name] = value
    return kept


def _strip_nested(annotation: Any, value: Any, param: str) -> Any:
    models = _models_in(annotation)
    if not models:
        return value
    if isinstance(value, dict):
        return _strip(_member_for(models, value), value, param)
    if isinstance(value, list):
        return [
            _strip(_member_for(models, item), item, f"{param}[{i}]") if isinstance(item, dict) else item
            for i, item in enumerate(value)
        ]
    return value


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's objects are checked against (inside list[...], unions, X | None)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models_in(arg)]


def _member_for(models: list[type[BaseModel]], item: dict) -> type[BaseModel]:
    """The model of a union that a JSON object is for: the one whose ``type`` literal holds the object's
    ``type`` (a Responses input item), else the one without a ``type`` field (a message)."""
    for model in models:
        field = model.model_fields.get("type")
        if field is not None and item.get("type") in get_args(field.annotation):
            return model
    return next((model for model in models if "type" not in model.model_fields), models[0])


def _check(no_op: NoOp, value: Any, param: str) -> None:
    if value is None or no_op.values is None or any(_same(value, accepted) for accepted in no_op.values):
        return
    shown = json.dumps(value, ensure_ascii=False)
    shown = shown if len(shown) <= 60 else f"{shown[:60]}…"
    accepted = " or ".join(json.dumps(v) for v in no_op.values) or "null"
    raise ApiError(
        400,
        f"{param}={shown} is not supported: {no_op.missing} (accepted: {accepted}, or leave it out)",
        code="unsupported_value",
        param=param,
    )


def _same(value: Any, accepted: Any) -> bool:
    """JSON equality, where ``true`` is not ``1`` but ``0`` is ``0.0``."""
    if _is_number(value) and _is_number(accepted):
        return bool(value == accepted)
    return json.dumps(value, sort_keys=True) == json.dumps(accepted, sort_keys=True)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
