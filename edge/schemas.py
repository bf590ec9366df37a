"""Request bodies the edge accepts, as pydantic models: the page's REST API and OpenAI's chat completions.

The page's API refuses unknown fields (a typo is an error, not a silent default). The OpenAI-compatible
body ignores fields it does not know, as OpenAI-compatible servers do, so SDK upgrades keep working.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatmesh.limits import Limits

# The limits the API fixes. Those an operator sets (message size, model-name length, max_tokens) are the
# orchestrator's flags: the edge leaves them to the orchestrator, whose refusals it maps (413, 400).
API = Limits()
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, le=UINT64_MAX)]


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


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptionsIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionIn(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
    # One choice per request is all chatmesh generates.
    n: Literal[1] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)
