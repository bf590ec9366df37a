"""Request bodies the edge accepts, as pydantic models: the page's REST API and OpenAI's chat completions.

Every body refuses unknown fields (a typo is an error, not a silent default), as OpenAI's API does. The
OpenAI fields chatmesh knows but does not serve are accepted at their no-op values only, by
edge/openai_fields.py, before these models see a body.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatmesh.limits import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Limits

# The limits the API fixes. Those an operator sets (message size, model-name length, max_tokens) are the
# orchestrator's flags: the edge leaves them to the orchestrator, whose refusals it maps (413, 400).
API = Limits()
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, le=UINT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# OpenAI's logit_bias: token ids (of the served model's tokenizer) as JSON object keys.
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)


class GenerationOptionsIn(Strict):
    model: str = ""
    max_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list, max_length=API.max_stop_sequences)


class CreateChatIn(Strict):
    title: str = Field("", max_length=API.max_title_chars)


class RenameChatIn(Strict):
    title: str = Field(min_length=1, max_length=API.max_title_chars)


class SendMessageIn(Strict):
    content: str = Field(min_length=1)
    parent_message_id: str = Field("", max_length=API.max_id_chars)
    idempotency_key: str = Field("", max_length=API.max_idempotency_key_chars)
    options: GenerationOptionsIn = Field(default_factory=GenerationOptionsIn)


class RegenerateIn(Strict):
    idempotency_key: str = Field("", max_length=API.max_idempotency_key_chars)
    options: GenerationOptionsIn = Field(default_factory=GenerationOptionsIn)


class TextPart(Strict):
    # "text" in chat completions; the Responses API's input items say "input_text", and an assistant
    # turn given back as input carries its "output_text".
    type: Literal["text", "input_text", "output_text"]
    text: str


class ChatMessageIn(Strict):
    """A message of chat completions, and an input message item of the Responses API (whose ``type``,
    "message", is a no-op of edge/openai_fields.py)."""

    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptionsIn(Strict):
    include_usage: bool = False


class ChatCompletionIn(Strict):
    # Empty: the server's default model (OpenAI requires it; we do not, so curl examples stay short).
    model: str = ""
    messages: list[ChatMessageIn] = Field(min_length=1, max_length=API.max_prompt_messages)
    stream: bool = False
    stream_options: StreamOptionsIn | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=API.max_stop_sequences)] | None = None
    max_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    # OpenAI's newer name for max_tokens; wins when both are given.
    max_completion_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extension (OpenAI has none): drop tokens less likely than min_p times the likeliest.
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ResponseCreateIn(Strict):
    """``POST /v1/responses``: the text subset of OpenAI's Responses API (no tools, files or images)."""

    model: str = ""
    input: str | Annotated[list[ChatMessageIn], Field(min_length=1, max_length=API.max_prompt_messages)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=API.max_id_chars)
    # Stored responses are runs of a chat (retrievable, resumable, chainable); unstored ones are not kept.
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None

    def messages(self) -> list[ChatMessageIn]:
        if isinstance(self.input, str):
            return [ChatMessageIn(role="user", content=self.input)]
        return list(self.input)
