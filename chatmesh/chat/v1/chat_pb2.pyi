import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_USER: _ClassVar[Role]
    ROLE_ASSISTANT: _ClassVar[Role]
    ROLE_SYSTEM: _ClassVar[Role]
    ROLE_TOOL: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_CONTENT_FILTER: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]

class RunStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATUS_UNSPECIFIED: _ClassVar[RunStatus]
    RUN_STATUS_IN_PROGRESS: _ClassVar[RunStatus]
    RUN_STATUS_COMPLETED: _ClassVar[RunStatus]
    RUN_STATUS_CANCELLED: _ClassVar[RunStatus]
    RUN_STATUS_FAILED: _ClassVar[RunStatus]
    RUN_STATUS_INTERRUPTED: _ClassVar[RunStatus]
    RUN_STATUS_CANCELLING: _ClassVar[RunStatus]

class ToolOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TOOL_OUTCOME_UNSPECIFIED: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_OK: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_ERROR: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_TIMEOUT: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_REFUSED: _ClassVar[ToolOutcome]
    TOOL_OUTCOME_INTERRUPTED: _ClassVar[ToolOutcome]
ROLE_UNSPECIFIED: Role
ROLE_USER: Role
ROLE_ASSISTANT: Role
ROLE_SYSTEM: Role
ROLE_TOOL: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_CONTENT_FILTER: FinishReason
FINISH_REASON_ERROR: FinishReason
RUN_STATUS_UNSPECIFIED: RunStatus
RUN_STATUS_IN_PROGRESS: RunStatus
RUN_STATUS_COMPLETED: RunStatus
RUN_STATUS_CANCELLED: RunStatus
RUN_STATUS_FAILED: RunStatus
RUN_STATUS_INTERRUPTED: RunStatus
RUN_STATUS_CANCELLING: RunStatus
TOOL_OUTCOME_UNSPECIFIED: ToolOutcome
TOOL_OUTCOME_OK: ToolOutcome
TOOL_OUTCOME_ERROR: ToolOutcome
TOOL_OUTCOME_TIMEOUT: ToolOutcome
TOOL_OUTCOME_REFUSED: ToolOutcome
TOOL_OUTCOME_INTERRUPTED: ToolOutcome

class Chat(_message.Message):
    __slots__ = ("chat_id", "title", "create_time", "update_time", "active_run_id", "model", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    UPDATE_TIME_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    title: str
    create_time: _timestamp_pb2.Timestamp
    update_time: _timestamp_pb2.Timestamp
    active_run_id: str
    model: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, chat_id: _Optional[str] = ..., title: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., update_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., active_run_id: _Optional[str] = ..., model: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("message_id", "chat_id", "parent_id", "role", "content", "token_count", "model", "finish_reason", "create_time", "run_id", "usage", "tool_calls", "tool_call_id", "tool_name")
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAME_FIELD_NUMBER: _ClassVar[int]
    message_id: str
    chat_id: str
    parent_id: str
    role: Role
    content: str
    token_count: int
    model: str
    finish_reason: FinishReason
    create_time: _timestamp_pb2.Timestamp
    run_id: str
    usage: Usage
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    tool_name: str
    def __init__(self, message_id: _Optional[str] = ..., chat_id: _Optional[str] = ..., parent_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ..., token_count: _Optional[int] = ..., model: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., run_id: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., tool_name: _Optional[str] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolResult(_message.Message):
    __slots__ = ("tool_call_id", "content")
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    tool_call_id: str
    content: str
    def __init__(self, tool_call_id: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class GenerationOptions(_message.Message):
    __slots__ = ("model", "max_tokens", "temperature", "top_p", "seed", "stop", "structured", "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "logprobs", "top_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    model: str
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    structured: StructuredOutput
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    logprobs: bool
    top_logprobs: int
    def __init__(self, model: _Optional[str] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("json_schema", "json_object", "regex", "choice", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    json_object: bool
    regex: str
    choice: StructuredChoices
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[StructuredChoices, _Mapping]] = ..., grammar: _Optional[str] = ...) -> None: ...

class StructuredChoices(_message.Message):
    __slots__ = ("choices",)
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, choices: _Optional[_Iterable[str]] = ...) -> None: ...

class RunStarted(_message.Message):
    __slots__ = ("run_id", "chat_id", "user_message_id", "assistant_message_id", "model", "degraded")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    USER_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    chat_id: str
    user_message_id: str
    assistant_message_id: str
    model: str
    degraded: bool
    def __init__(self, run_id: _Optional[str] = ..., chat_id: _Optional[str] = ..., user_message_id: _Optional[str] = ..., assistant_message_id: _Optional[str] = ..., model: _Optional[str] = ..., degraded: _Optional[bool] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("text", "token_count", "logprobs")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_count: int
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, text: _Optional[str] = ..., token_count: _Optional[int] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "token_bytes", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    token_bytes: bytes
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., token_bytes: _Optional[bytes] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Done(_message.Message):
    __slots__ = ("finish_reason", "assistant_message_id")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    assistant_message_id: str
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., assistant_message_id: _Optional[str] = ...) -> None: ...

class RunError(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class RunEvent(_message.Message):
    __slots__ = ("seq", "started", "delta", "usage", "done", "error", "step_started", "step_result")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    STEP_STARTED_FIELD_NUMBER: _ClassVar[int]
    STEP_RESULT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    started: RunStarted
    delta: Delta
    usage: Usage
    done: Done
    error: RunError
    step_started: ToolStepStarted
    step_result: ToolStepResult
    def __init__(self, seq: _Optional[int] = ..., started: _Optional[_Union[RunStarted, _Mapping]] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., done: _Optional[_Union[Done, _Mapping]] = ..., error: _Optional[_Union[RunError, _Mapping]] = ..., step_started: _Optional[_Union[ToolStepStarted, _Mapping]] = ..., step_result: _Optional[_Union[ToolStepResult, _Mapping]] = ...) -> None: ...

class ToolStepStarted(_message.Message):
    __slots__ = ("call_id", "tool", "arguments")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool: str
    arguments: str
    def __init__(self, call_id: _Optional[str] = ..., tool: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ToolStepResult(_message.Message):
    __slots__ = ("call_id", "tool", "outcome", "text")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    TOOL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    call_id: str
    tool: str
    outcome: ToolOutcome
    text: str
    def __init__(self, call_id: _Optional[str] = ..., tool: _Optional[str] = ..., outcome: _Optional[_Union[ToolOutcome, str]] = ..., text: _Optional[str] = ...) -> None: ...

class CreateChatRequest(_message.Message):
    __slots__ = ("title", "idempotency_key", "model", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TITLE_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    title: str
    idempotency_key: str
    model: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, title: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., model: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class CreateChatResponse(_message.Message):
    __slots__ = ("chat",)
    CHAT_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class GetChatRequest(_message.Message):
    __slots__ = ("chat_id",)
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    def __init__(self, chat_id: _Optional[str] = ...) -> None: ...

class GetChatResponse(_message.Message):
    __slots__ = ("chat",)
    CHAT_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class ListChatsRequest(_message.Message):
    __slots__ = ("page_size", "page_token")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    page_token: str
    def __init__(self, page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListChatsResponse(_message.Message):
    __slots__ = ("chats", "next_page_token")
    CHATS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    chats: _containers.RepeatedCompositeFieldContainer[Chat]
    next_page_token: str
    def __init__(self, chats: _Optional[_Iterable[_Union[Chat, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class RenameChatRequest(_message.Message):
    __slots__ = ("chat_id", "title")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    TITLE_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    title: str
    def __init__(self, chat_id: _Optional[str] = ..., title: _Optional[str] = ...) -> None: ...

class RenameChatResponse(_message.Message):
    __slots__ = ("chat",)
    CHAT_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class SetChatMetadataRequest(_message.Message):
    __slots__ = ("chat_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, chat_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class SetChatMetadataResponse(_message.Message):
    __slots__ = ("chat",)
    CHAT_FIELD_NUMBER: _ClassVar[int]
    chat: Chat
    def __init__(self, chat: _Optional[_Union[Chat, _Mapping]] = ...) -> None: ...

class AppendMessagesRequest(_message.Message):
    __slots__ = ("chat_id", "messages")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    messages: _containers.RepeatedCompositeFieldContainer[PromptMessage]
    def __init__(self, chat_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[PromptMessage, _Mapping]]] = ...) -> None: ...

class AppendMessagesResponse(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ...) -> None: ...

class DeleteMessageRequest(_message.Message):
    __slots__ = ("chat_id", "message_id")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    message_id: str
    def __init__(self, chat_id: _Optional[str] = ..., message_id: _Optional[str] = ...) -> None: ...

class DeleteMessageResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeleteChatRequest(_message.Message):
    __slots__ = ("chat_id",)
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    def __init__(self, chat_id: _Optional[str] = ...) -> None: ...

class DeleteChatResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListMessagesRequest(_message.Message):
    __slots__ = ("chat_id", "page_size", "page_token")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    page_size: int
    page_token: str
    def __init__(self, chat_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListMessagesResponse(_message.Message):
    __slots__ = ("messages", "next_page_token")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    next_page_token: str
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class GetBranchRequest(_message.Message):
    __slots__ = ("chat_id", "leaf_message_id", "page_size", "page_token", "newest_leaf")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    LEAF_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NEWEST_LEAF_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    leaf_message_id: str
    page_size: int
    page_token: str
    newest_leaf: bool
    def __init__(self, chat_id: _Optional[str] = ..., leaf_message_id: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ..., newest_leaf: _Optional[bool] = ...) -> None: ...

class GetBranchResponse(_message.Message):
    __slots__ = ("messages", "next_page_token", "versions")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    next_page_token: str
    versions: _containers.RepeatedCompositeFieldContainer[Versions]
    def __init__(self, messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., next_page_token: _Optional[str] = ..., versions: _Optional[_Iterable[_Union[Versions, _Mapping]]] = ...) -> None: ...

class Versions(_message.Message):
    __slots__ = ("count", "number", "previous_id", "next_id")
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_ID_FIELD_NUMBER: _ClassVar[int]
    NEXT_ID_FIELD_NUMBER: _ClassVar[int]
    count: int
    number: int
    previous_id: str
    next_id: str
    def __init__(self, count: _Optional[int] = ..., number: _Optional[int] = ..., previous_id: _Optional[str] = ..., next_id: _Optional[str] = ...) -> None: ...

class SendMessageRequest(_message.Message):
    __slots__ = ("chat_id", "content", "parent_message_id", "idempotency_key", "options", "branch_from_root", "instructions", "merge_deltas", "tool_results")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARENT_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    BRANCH_FROM_ROOT_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTIONS_FIELD_NUMBER: _ClassVar[int]
    MERGE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    TOOL_RESULTS_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    content: str
    parent_message_id: str
    idempotency_key: str
    options: GenerationOptions
    branch_from_root: bool
    instructions: str
    merge_deltas: bool
    tool_results: _containers.RepeatedCompositeFieldContainer[ToolResult]
    def __init__(self, chat_id: _Optional[str] = ..., content: _Optional[str] = ..., parent_message_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., options: _Optional[_Union[GenerationOptions, _Mapping]] = ..., branch_from_root: _Optional[bool] = ..., instructions: _Optional[str] = ..., merge_deltas: _Optional[bool] = ..., tool_results: _Optional[_Iterable[_Union[ToolResult, _Mapping]]] = ...) -> None: ...

class SendMessageResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class RegenerateMessageRequest(_message.Message):
    __slots__ = ("chat_id", "message_id", "idempotency_key", "options", "merge_deltas")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MERGE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    message_id: str
    idempotency_key: str
    options: GenerationOptions
    merge_deltas: bool
    def __init__(self, chat_id: _Optional[str] = ..., message_id: _Optional[str] = ..., idempotency_key: _Optional[str] = ..., options: _Optional[_Union[GenerationOptions, _Mapping]] = ..., merge_deltas: _Optional[bool] = ...) -> None: ...

class RegenerateMessageResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class StreamRunRequest(_message.Message):
    __slots__ = ("run_id", "after_seq", "merge_deltas")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    MERGE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq: int
    merge_deltas: bool
    def __init__(self, run_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., merge_deltas: _Optional[bool] = ...) -> None: ...

class StreamRunResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class Run(_message.Message):
    __slots__ = ("run_id", "chat_id", "status", "last_seq", "assistant_message_id", "create_time")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    chat_id: str
    status: RunStatus
    last_seq: int
    assistant_message_id: str
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, run_id: _Optional[str] = ..., chat_id: _Optional[str] = ..., status: _Optional[_Union[RunStatus, str]] = ..., last_seq: _Optional[int] = ..., assistant_message_id: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GetRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class GetRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class CancelRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class CancelRunResponse(_message.Message):
    __slots__ = ("run",)
    RUN_FIELD_NUMBER: _ClassVar[int]
    run: Run
    def __init__(self, run: _Optional[_Union[Run, _Mapping]] = ...) -> None: ...

class PromptMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: Role
    content: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., content: _Optional[str] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("messages", "options", "merge_deltas", "prompt")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    MERGE_DELTAS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[PromptMessage]
    options: GenerationOptions
    merge_deltas: bool
    prompt: str
    def __init__(self, messages: _Optional[_Iterable[_Union[PromptMessage, _Mapping]]] = ..., options: _Optional[_Union[GenerationOptions, _Mapping]] = ..., merge_deltas: _Optional[bool] = ..., prompt: _Optional[str] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("event",)
    EVENT_FIELD_NUMBER: _ClassVar[int]
    event: RunEvent
    def __init__(self, event: _Optional[_Union[RunEvent, _Mapping]] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Model(_message.Message):
    __slots__ = ("model_id", "context_length", "engines", "kind", "licence")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    LICENCE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    context_length: int
    engines: int
    kind: str
    licence: str
    def __init__(self, model_id: _Optional[str] = ..., context_length: _Optional[int] = ..., engines: _Optional[int] = ..., kind: _Optional[str] = ..., licence: _Optional[str] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[Model]
    def __init__(self, models: _Optional[_Iterable[_Union[Model, _Mapping]]] = ...) -> None: ...

class GetUsageRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetUsageResponse(_message.Message):
    __slots__ = ("tier", "used_tokens", "limit_tokens", "window_start_time", "window_end_time")
    TIER_FIELD_NUMBER: _ClassVar[int]
    USED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WINDOW_START_TIME_FIELD_NUMBER: _ClassVar[int]
    WINDOW_END_TIME_FIELD_NUMBER: _ClassVar[int]
    tier: str
    used_tokens: int
    limit_tokens: int
    window_start_time: _timestamp_pb2.Timestamp
    window_end_time: _timestamp_pb2.Timestamp
    def __init__(self, tier: _Optional[str] = ..., used_tokens: _Optional[int] = ..., limit_tokens: _Optional[int] = ..., window_start_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., window_end_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SearchChatsRequest(_message.Message):
    __slots__ = ("query", "page_size", "page_token")
    QUERY_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    query: str
    page_size: int
    page_token: str
    def __init__(self, query: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class SearchHit(_message.Message):
    __slots__ = ("chat_id", "chat_title", "message_id", "role", "snippet", "create_time")
    CHAT_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_TITLE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SNIPPET_FIELD_NUMBER: _ClassVar[int]
    CREATE_TIME_FIELD_NUMBER: _ClassVar[int]
    chat_id: str
    chat_title: str
    message_id: str
    role: Role
    snippet: str
    create_time: _timestamp_pb2.Timestamp
    def __init__(self, chat_id: _Optional[str] = ..., chat_title: _Optional[str] = ..., message_id: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., snippet: _Optional[str] = ..., create_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class SearchChatsResponse(_message.Message):
    __slots__ = ("hits", "next_page_token")
    HITS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    hits: _containers.RepeatedCompositeFieldContainer[SearchHit]
    next_page_token: str
    def __init__(self, hits: _Optional[_Iterable[_Union[SearchHit, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model", "inputs", "dimensions")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    def __init__(self, model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("vector_f32",)
    VECTOR_F32_FIELD_NUMBER: _ClassVar[int]
    vector_f32: bytes
    def __init__(self, vector_f32: _Optional[bytes] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("model", "embeddings", "prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...
