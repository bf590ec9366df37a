"""Reading request bodies safely: bounded size, strict UTF-8, JSON objects, schema-checked.

Bad input is refused here, before any orchestrator call: 413 for too large, 415 for a non-JSON content
type, 400 for everything else: bytes that are not UTF-8 or not JSON, JSON nested deeper than
``MAX_JSON_DEPTH`` or with a number of more than 4,300 digits (Python refuses to convert those), and JSON
whose fields are wrong (``invalid_request_error`` naming the field in ``param``, as OpenAI answers).
"""

from __future__ import annotations

import json
import types
from typing import Any, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from starlette.requests import Request

from edge.errors import ApiError

Model = TypeVar("Model", bound=BaseModel)
# No request body the API defines is nested more than a few levels; a deeper one is not a request.
MAX_JSON_DEPTH = 32


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refusing (413) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and len(declared.lstrip("0")) > len(str(max_bytes)):
        raise _too_large(max_bytes + 1, max_bytes)  # longer than any allowed size: no int() of it
    if declared.isascii() and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    body = bytearray()
    async for chunk in request.stream():
        body.extend(chunk)
        if len(body) > max_bytes:
            raise _too_large(len(body), max_bytes)
    return bytes(body)


def _too_large(size: int, max_bytes: int) -> ApiError:
    return ApiError(
        413,
        f"request body is larger than the limit of {max_bytes} bytes (got at least {size})",
        code="payload_too_large",
    )


def parse_json_object(raw: bytes) -> dict:
    """``raw`` as a JSON object; 400 with a precise reason otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"request body is not valid UTF-8 (byte {exc.start})", code="invalid_utf8"
        ) from exc
    if not text.strip():
        raise ApiError(400, "request body is empty; send a JSON object", code="invalid_json")
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", code="invalid_json"
        ) from exc
    except RecursionError as exc:
        raise _too_deep() from exc
    except ValueError as exc:  # an integer past Python's 4,300-digit conversion limit
        raise ApiError(
            400, "a JSON number in the request body has too many digits", code="invalid_json"
        ) from exc
    if _depth(value) > MAX_JSON_DEPTH:
        raise _too_deep()
    if not isinstance(value, dict):
        raise ApiError(
            400, f"request body must be a JSON object, got {type(value).__name__}", code="invalid_json"
        )
    try:
        # A "\ud800" escape decodes to a lone surrogate, which is not Unicode text and cannot be sent on.
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "request body escapes an unpaired UTF-16 surrogate", code="invalid_utf8") from exc
    return value


def _too_deep() -> ApiError:
    return ApiError(
        400, f"request body is nested more than {MAX_JSON_DEPTH} levels deep", code="invalid_json"
    )


def _depth(value: object) -> int:
    """How deeply ``value``'s arrays and objects nest (iterative: no recursion limit to hit)."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # past the limit the answer is known
            pending.extend((child, depth + 1) for child in children)
    return deepest


def _reject_constant(name: str) -> None:
    raise ApiError(400, f"malformed JSON: {name} is not a JSON number", code="invalid_json")


def check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type not in ("application/json", "") and not content_type.endswith("+json"):
        raise ApiError(415, f"content type {content_type!r} is not supported; send application/json")


async def read_json(request: Request, max_bytes: int) -> dict:
    """The body as a JSON object (see ``parse_json_object``)."""
    check_content_type(request)
    return parse_json_object(await read_body(request, max_bytes))


async def read_model(request: Request, model: type[Model], max_bytes: int) -> Model:
    """The body checked against ``model``; field errors are 400 naming the first bad field."""
    return validate_model(model, await read_json(request, max_bytes))


def validate_model(model: type[Model], data: dict) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        # An unknown field is what to name first: a union's other members fail on it too ("not a string").
        unknown = [error for error in errors if error["type"] == "extra_forbidden"]
        first = (unknown or errors)[0]
        param = _param(model, first) or None
        if unknown:
            raise ApiError(
                400, f"Unrecognized request argument supplied: {param}", code="unknown_parameter", param=param
            ) from exc
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(
            400, f"{param or 'body'}: {first['msg']}{more}", code="invalid_value", param=param
        ) from exc


def _param(model: type[BaseModel], error: ErrorDetails) -> str:
    """The field at fault as a client names it, ``messages[0].content``: pydantic's location without
    the union members it tried (``str``, ``list[TextPart]``), which are our type names, not fields."""
    path = ""
    current: type[BaseModel] | None = model
    last = len(error["loc"]) - 1
    for i, part in enumerate(error["loc"]):
        if isinstance(part, int):
            path += f"[{part}]"
        elif current is not None and part in current.model_fields:
            path += f".{part}" if path else part
            current = _model_in(current.model_fields[part].annotation)
        elif error["type"] == "extra_forbidden" and i == last:
            name = part or '""'  # the unknown field itself, even one named ""
            path += f".{name}" if path else name
    return path


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The model a field's values are checked against (inside list[...], X | None, ...), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (list, Union, types.UnionType) or get_args(annotation):
        for arg in get_args(annotation):
            if (found := _model_in(arg)) is not None:
                return found
    return None
