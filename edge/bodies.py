"""Reading request bodies safely: bounded size, strict UTF-8, JSON objects, schema-checked.

Bad input is refused here, before any orchestrator call: 413 for too large, 415 for a non-JSON content
type, 400 for bytes that are not UTF-8 or not JSON, 422 for JSON whose fields are wrong (naming the field).
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from edge.errors import ApiError

Model = TypeVar("Model", bound=BaseModel)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refusing (413) as soon as it is known to exceed ``max_bytes``."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
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


def _reject_constant(name: str) -> None:
    raise ApiError(400, f"malformed JSON: {name} is not a JSON number", code="invalid_json")


def check_content_type(request: Request) -> None:
    content_type = request.headers.get("content-type", "application/json").split(";")[0].strip().lower()
    if content_type not in ("application/json", "") and not content_type.endswith("+json"):
        raise ApiError(415, f"content type {content_type!r} is not supported; send application/json")


async def read_model(request: Request, model: type[Model], max_bytes: int) -> Model:
    """The body checked against ``model``; field errors are 422 naming the first bad field."""
    check_content_type(request)
    data = parse_json_object(await read_body(request, max_bytes))
    return validate_model(model, data)


def validate_model(model: type[Model], data: dict) -> Model:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise ApiError(
            422, f"{param or 'body'}: {first['msg']}{more}", code="invalid_value", param=param
        ) from exc
