"""OpenAI's ways of asking for structured output, as the ChatService's constraint (``StructuredOutput``):
Chat Completions' ``response_format``, the Responses API's ``text.format``, and vLLM's
``structured_outputs`` (json, regex, choice, grammar) as a documented extension.

The engine compiles and enforces the constraint (docs/structured-outputs.md); a schema it cannot
compile comes back as 400 naming the body field it came from (``refused_constraint``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from chatmesh.chat.v1 import chat_pb2
from edge.errors import ApiError
from edge.strict import Strict

# The engine's name for the constraint in its refusals: the edge names the body's field instead.
ENGINE_FIELD = "sampling.structured"
FunctionName = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]


class JsonSchemaIn(Strict):
    """``response_format.json_schema`` of Chat Completions."""

    model_config = ConfigDict(populate_by_name=True)
    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    # Strict or not, the output is constrained to the schema (OpenAI's non-strict is best effort).
    strict: bool | None = None


class ResponseFormatIn(Strict):
    """Chat Completions' ``response_format``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaIn | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormatIn:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only with it")
        return self


class TextFormatIn(Strict):
    """The Responses API's ``text.format`` (the json_schema fields beside ``type``)."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: FunctionName | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormatIn:
        if (self.type == "json_schema") != (self.schema_ is not None and self.name is not None):
            raise ValueError("name and schema are required with type 'json_schema', and only with it")
        return self


class TextIn(Strict):
    """The Responses API's ``text``."""

    format: TextFormatIn | None = None
    verbosity: Literal["medium"] | None = None  # the only one served: the default


class StructuredOutputsIn(Strict):
    """vLLM's ``structured_outputs`` (an extension of Chat Completions): exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: Literal[True] | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsIn:
        given = [name for name, value in self if value is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, json_object, regex, choice, grammar")
        return self

    def proto(self) -> chat_pb2.StructuredOutput:
        if self.json_ is not None:
            spec = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return chat_pb2.StructuredOutput(json_schema=spec)
        if self.json_object:
            return chat_pb2.StructuredOutput(json_object=True)
        if self.choice is not None:
            return chat_pb2.StructuredOutput(choice=chat_pb2.StructuredChoices(choices=self.choice))
        if self.regex is not None:
            return chat_pb2.StructuredOutput(regex=self.regex)
        return chat_pb2.StructuredOutput(grammar=self.grammar or "")


def json_schema_output(schema: dict[str, Any]) -> chat_pb2.StructuredOutput:
    return chat_pb2.StructuredOutput(json_schema=json.dumps(schema))


def response_format_proto(fmt: ResponseFormatIn | None) -> chat_pb2.StructuredOutput | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return chat_pb2.StructuredOutput(json_object=True)
    assert fmt.json_schema is not None  # validated
    return json_schema_output(fmt.json_schema.schema_)


def text_format_proto(text: TextIn | None) -> chat_pb2.StructuredOutput | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return chat_pb2.StructuredOutput(json_object=True)
    assert fmt.schema_ is not None  # validated
    return json_schema_output(fmt.schema_)


def refused_constraint(error: ApiError, param: str) -> ApiError:
    """``error`` naming ``param`` when it is the engine's refusal of the constraint ``param`` asked for
    (a schema it cannot compile), in the body's terms rather than the engine's."""
    if error.status == 400 and error.message.startswith(ENGINE_FIELD):
        error.message = f"{param}: {error.message.removeprefix(ENGINE_FIELD).lstrip('.: ')}"
        error.param, error.code = param, "invalid_value"
    return error
