"""Request bodies the edge accepts, as pydantic models: the page's REST API and OpenAI's chat completions.

Every body refuses unknown fields (a typo is an error, not a silent default), as OpenAI's API does. The
OpenAI fields chatmesh knows but does not serve are accepted at their no-op values only, by
edge/openai_fields.py, before these models see a body.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator

from chatmesh.limits import MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, Limits
from edge.strict import Strict
from edge.structured_outputs import ResponseFormatIn, StructuredOutputsIn, TextIn
from edge.tools import FunctionIn, ResponseToolIn, ToolCallIn, ToolChoice, ToolIn

# The limits the API fixes. Those an operator sets (message size, model-name length, max_tokens) are the
# orchestrator's flags: the edge leaves them to the orchestrator, whose refusals it maps (413, 400).
API = Limits()
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# Choices of one Chat Completion (OpenAI allows 128): each is a run of its own (edge/choices.py).
MAX_CHOICES = 8

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Seed = Annotated[int, Field(ge=0, le=UINT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# OpenAI's logit_bias: token ids (of the served model's tokenizer) as JSON object keys.
TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]
Bias = Annotated[float, Field(ge=-100.0, le=100.0)]


class GenerationOptionsIn(Strict):
    model: str = ""
    max_tokens: int = Field(0, ge=0, le=UINT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: list[str] = Field(default_factory=list, max_length=API.max_stop_sequences)
    # Each answer token's log-probability on its delta events (stored with the run: a resumed stream
    # gets them again), with this many likeliest alternatives.
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)


class CreateChatIn(Strict):
    title: str = Field("", max_length=API.max_title_chars)
    # A chat model (GET /v1/models, kind "chat"); empty: the server's default at each send.
    model: str = ""


class RenameChatIn(Strict):
    title: str = Field(min_length=1, max_length=API.max_title_chars)


class ToolResultIn(Strict):
    """The result of a tool call the caller ran: a ``tool`` message of the stored chat."""

    tool_call_id: str = Field(min_length=1, max_length=API.max_id_chars)
    content: str  # may be empty: a tool may return nothing


class SendMessageIn(Strict):
    # Instead of content: the results of the calls of the message the send follows, one per call (so
    # no more than it made: the orchestrator refuses a result that names none).
    tool_results: list[ToolResultIn] = Field(default_factory=list)
    content: str = Field("", validate_default=True)
    parent_message_id: str = Field("", max_length=API.max_id_chars)
    idempotency_key: str = Field("", max_length=API.max_idempotency_key_chars)
    options: GenerationOptionsIn = Field(default_factory=GenerationOptionsIn)

    @field_validator("content")
    @classmethod
    def _content_or_tool_results(cls, content: str, info: ValidationInfo) -> str:
        given = bool(info.data.get("tool_results"))
        if given == bool(content):
            raise ValueError("give content (not empty) or tool_results, not both")
        return content


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

    # "developer" is OpenAI's newer name for "system"; "tool" gives a tool call's result back.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None: an assistant turn that only called tools.
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, validate_default=True)  # an assistant turn's calls
    tool_call_id: str | None = Field(None, validate_default=True)  # a tool result's call

    @field_validator("tool_call_id")
    @classmethod
    def _result_names_its_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        if (info.data.get("role") == "tool") != (value is not None):
            raise ValueError("a tool message, and only a tool message, names its call's tool_call_id")
        return value

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_the_assistants(cls, value: list[ToolCallIn] | None, info: ValidationInfo) -> object:
        if value is not None and info.data.get("role") != "assistant":
            raise ValueError("only an assistant message carries tool_calls")
        return value

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionCallItemIn(Strict):
    """A Responses API input item: a function call of an earlier answer, given back."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItemIn(Strict):
    """A Responses API input item: the result of a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str


class StreamOptionsIn(Strict):
    include_usage: bool = False


def stop_list(stop: str | list[str] | None) -> list[str]:
    """OpenAI's ``stop``, a string or a list of them, as a list."""
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


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
    response_format: ResponseFormatIn | None = None
    # vLLM's extension: a JSON schema, regex, choice or grammar (docs/structured-outputs.md).
    structured_outputs: StructuredOutputsIn | None = None
    tools: list[ToolIn] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # vLLM's extension (OpenAI has none): drop tokens less likely than min_p times the likeliest.
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Choices, each a run of its own (edge.choices); strict: `true` is not 1.
    n: int | None = Field(None, ge=1, le=MAX_CHOICES, strict=True)

    def functions(self) -> list[FunctionIn]:
        return [tool.function for tool in self.tools or []]


class CompletionIn(Strict):
    """``POST /v1/completions``, OpenAI's legacy route: one prompt string continued as it is (no chat
    template), the only input a completion model (a base model) takes."""

    model: str = ""
    prompt: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptionsIn | None = None
    # OpenAI's default for this route (16), not chat's.
    max_tokens: int = Field(16, ge=1, le=UINT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: str | Annotated[list[str], Field(max_length=API.max_stop_sequences)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    # The likeliest alternatives per token (0: the chosen token's logprob alone).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


InputItem = FunctionCallItemIn | FunctionCallOutputItemIn | ChatMessageIn


class ConversationRefIn(Strict):
    id: str = Field(max_length=API.max_id_chars)


class ResponseCreateIn(Strict):
    """``POST /v1/responses``: text and function calling in OpenAI's Responses API (no files, images
    or hosted tools)."""

    model: str = ""
    input: str | Annotated[list[InputItem], Field(min_length=1, max_length=API.max_prompt_messages)]
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=API.max_id_chars)
    # The conversation it continues (edge/conversations_api.py): its items are the history, and the
    # input and the answer are added to it.
    conversation: Annotated[str, Field(max_length=API.max_id_chars)] | ConversationRefIn | None = None
    # Stored responses are runs of a chat (retrievable, resumable, chainable); unstored ones are not kept.
    store: bool = True
    background: bool = False
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1, le=UINT32_MAX)
    temperature: Temperature | None = None
    top_p: TopP | None = None
    text: TextIn | None = None
    tools: list[ResponseToolIn] = Field(default_factory=list, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    @property
    def conversation_id(self) -> str | None:
        return self.conversation.id if isinstance(self.conversation, ConversationRefIn) else self.conversation

    def messages(self) -> list[ChatMessageIn]:
        """The input as chat messages: a function call given back is an assistant turn that called it,
        its output a tool result."""
        if isinstance(self.input, str):
            return [ChatMessageIn(role="user", content=self.input)]
        messages: list[ChatMessageIn] = []
        for item in self.input:
            if isinstance(item, FunctionCallItemIn):
                call = ToolCallIn(id=item.call_id, function={"name": item.name, "arguments": item.arguments})
                if messages and messages[-1].role == "assistant" and messages[-1].tool_calls is not None:
                    messages[-1].tool_calls.append(call)  # parallel calls: one assistant turn
                else:
                    messages.append(ChatMessageIn(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItemIn):
                messages.append(ChatMessageIn(role="tool", content=item.output, tool_call_id=item.call_id))
            else:
                messages.append(item)
        return messages


# A token id of an embedding input (OpenAI's token-array input): a JSON integer, never a string or bool.
EmbeddingTokenId = Annotated[int, Field(strict=True, ge=0, le=UINT32_MAX)]


class EmbeddingIn(Strict):
    """``POST /v1/embeddings``: a string, a list of strings, a token array or a list of token arrays.
    The inputs' own limits (empty, too long, too many) are the engine's and orchestrator's to say."""

    model: str = Field(min_length=1)
    input: str | list[str] | list[EmbeddingTokenId] | list[list[EmbeddingTokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=UINT32_MAX)
    user: str | None = None  # accepted: who the call is for is the bearer token's
