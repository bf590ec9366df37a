from chatmesh.chat.v1 import chat_pb2 as _chat_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompleteManyRequest(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[CompleteRequestFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[CompleteRequestFrame, _Mapping]]] = ...) -> None: ...

class CompleteRequestFrame(_message.Message):
    __slots__ = ("request_id", "start", "cancel", "trace_context", "timeout_ms")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    start: CompleteStart
    cancel: CompleteCancel
    trace_context: _containers.ScalarMap[str, str]
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[_Union[CompleteStart, _Mapping]] = ..., cancel: _Optional[_Union[CompleteCancel, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class CompleteStart(_message.Message):
    __slots__ = ("request_id", "authorization", "request", "send", "regenerate", "stream_run", "create_chat", "get_chat", "list_chats", "rename_chat", "delete_chat", "list_messages", "get_run", "cancel_run", "list_models", "get_usage", "search_chats", "get_branch", "set_chat_metadata", "append_messages", "delete_message", "embed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORIZATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    REGENERATE_FIELD_NUMBER: _ClassVar[int]
    STREAM_RUN_FIELD_NUMBER: _ClassVar[int]
    CREATE_CHAT_FIELD_NUMBER: _ClassVar[int]
    GET_CHAT_FIELD_NUMBER: _ClassVar[int]
    LIST_CHATS_FIELD_NUMBER: _ClassVar[int]
    RENAME_CHAT_FIELD_NUMBER: _ClassVar[int]
    DELETE_CHAT_FIELD_NUMBER: _ClassVar[int]
    LIST_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GET_RUN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RUN_FIELD_NUMBER: _ClassVar[int]
    LIST_MODELS_FIELD_NUMBER: _ClassVar[int]
    GET_USAGE_FIELD_NUMBER: _ClassVar[int]
    SEARCH_CHATS_FIELD_NUMBER: _ClassVar[int]
    GET_BRANCH_FIELD_NUMBER: _ClassVar[int]
    SET_CHAT_METADATA_FIELD_NUMBER: _ClassVar[int]
    APPEND_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DELETE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    authorization: str
    request: _chat_pb2.CompleteRequest
    send: _chat_pb2.SendMessageRequest
    regenerate: _chat_pb2.RegenerateMessageRequest
    stream_run: _chat_pb2.StreamRunRequest
    create_chat: _chat_pb2.CreateChatRequest
    get_chat: _chat_pb2.GetChatRequest
    list_chats: _chat_pb2.ListChatsRequest
    rename_chat: _chat_pb2.RenameChatRequest
    delete_chat: _chat_pb2.DeleteChatRequest
    list_messages: _chat_pb2.ListMessagesRequest
    get_run: _chat_pb2.GetRunRequest
    cancel_run: _chat_pb2.CancelRunRequest
    list_models: _chat_pb2.ListModelsRequest
    get_usage: _chat_pb2.GetUsageRequest
    search_chats: _chat_pb2.SearchChatsRequest
    get_branch: _chat_pb2.GetBranchRequest
    set_chat_metadata: _chat_pb2.SetChatMetadataRequest
    append_messages: _chat_pb2.AppendMessagesRequest
    delete_message: _chat_pb2.DeleteMessageRequest
    embed: _chat_pb2.EmbedRequest
    def __init__(self, request_id: _Optional[str] = ..., authorization: _Optional[str] = ..., request: _Optional[_Union[_chat_pb2.CompleteRequest, _Mapping]] = ..., send: _Optional[_Union[_chat_pb2.SendMessageRequest, _Mapping]] = ..., regenerate: _Optional[_Union[_chat_pb2.RegenerateMessageRequest, _Mapping]] = ..., stream_run: _Optional[_Union[_chat_pb2.StreamRunRequest, _Mapping]] = ..., create_chat: _Optional[_Union[_chat_pb2.CreateChatRequest, _Mapping]] = ..., get_chat: _Optional[_Union[_chat_pb2.GetChatRequest, _Mapping]] = ..., list_chats: _Optional[_Union[_chat_pb2.ListChatsRequest, _Mapping]] = ..., rename_chat: _Optional[_Union[_chat_pb2.RenameChatRequest, _Mapping]] = ..., delete_chat: _Optional[_Union[_chat_pb2.DeleteChatRequest, _Mapping]] = ..., list_messages: _Optional[_Union[_chat_pb2.ListMessagesRequest, _Mapping]] = ..., get_run: _Optional[_Union[_chat_pb2.GetRunRequest, _Mapping]] = ..., cancel_run: _Optional[_Union[_chat_pb2.CancelRunRequest, _Mapping]] = ..., list_models: _Optional[_Union[_chat_pb2.ListModelsRequest, _Mapping]] = ..., get_usage: _Optional[_Union[_chat_pb2.GetUsageRequest, _Mapping]] = ..., search_chats: _Optional[_Union[_chat_pb2.SearchChatsRequest, _Mapping]] = ..., get_branch: _Optional[_Union[_chat_pb2.GetBranchRequest, _Mapping]] = ..., set_chat_metadata: _Optional[_Union[_chat_pb2.SetChatMetadataRequest, _Mapping]] = ..., append_messages: _Optional[_Union[_chat_pb2.AppendMessagesRequest, _Mapping]] = ..., delete_message: _Optional[_Union[_chat_pb2.DeleteMessageRequest, _Mapping]] = ..., embed: _Optional[_Union[_chat_pb2.EmbedRequest, _Mapping]] = ...) -> None: ...

class CompleteCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteManyResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[CompleteResponseFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[CompleteResponseFrame, _Mapping]]] = ...) -> None: ...

class CompleteResponseFrame(_message.Message):
    __slots__ = ("request_id", "event", "finished", "failed", "reply")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    event: _chat_pb2.RunEvent
    finished: CompleteFinished
    failed: CompleteFailed
    reply: CallReply
    def __init__(self, request_id: _Optional[str] = ..., event: _Optional[_Union[_chat_pb2.RunEvent, _Mapping]] = ..., finished: _Optional[_Union[CompleteFinished, _Mapping]] = ..., failed: _Optional[_Union[CompleteFailed, _Mapping]] = ..., reply: _Optional[_Union[CallReply, _Mapping]] = ...) -> None: ...

class CallReply(_message.Message):
    __slots__ = ("create_chat", "get_chat", "list_chats", "rename_chat", "delete_chat", "list_messages", "get_run", "cancel_run", "list_models", "get_usage", "search_chats", "get_branch", "set_chat_metadata", "append_messages", "delete_message", "embed")
    CREATE_CHAT_FIELD_NUMBER: _ClassVar[int]
    GET_CHAT_FIELD_NUMBER: _ClassVar[int]
    LIST_CHATS_FIELD_NUMBER: _ClassVar[int]
    RENAME_CHAT_FIELD_NUMBER: _ClassVar[int]
    DELETE_CHAT_FIELD_NUMBER: _ClassVar[int]
    LIST_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    GET_RUN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_RUN_FIELD_NUMBER: _ClassVar[int]
    LIST_MODELS_FIELD_NUMBER: _ClassVar[int]
    GET_USAGE_FIELD_NUMBER: _ClassVar[int]
    SEARCH_CHATS_FIELD_NUMBER: _ClassVar[int]
    GET_BRANCH_FIELD_NUMBER: _ClassVar[int]
    SET_CHAT_METADATA_FIELD_NUMBER: _ClassVar[int]
    APPEND_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    DELETE_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    EMBED_FIELD_NUMBER: _ClassVar[int]
    create_chat: _chat_pb2.CreateChatResponse
    get_chat: _chat_pb2.GetChatResponse
    list_chats: _chat_pb2.ListChatsResponse
    rename_chat: _chat_pb2.RenameChatResponse
    delete_chat: _chat_pb2.DeleteChatResponse
    list_messages: _chat_pb2.ListMessagesResponse
    get_run: _chat_pb2.GetRunResponse
    cancel_run: _chat_pb2.CancelRunResponse
    list_models: _chat_pb2.ListModelsResponse
    get_usage: _chat_pb2.GetUsageResponse
    search_chats: _chat_pb2.SearchChatsResponse
    get_branch: _chat_pb2.GetBranchResponse
    set_chat_metadata: _chat_pb2.SetChatMetadataResponse
    append_messages: _chat_pb2.AppendMessagesResponse
    delete_message: _chat_pb2.DeleteMessageResponse
    embed: _chat_pb2.EmbedResponse
    def __init__(self, create_chat: _Optional[_Union[_chat_pb2.CreateChatResponse, _Mapping]] = ..., get_chat: _Optional[_Union[_chat_pb2.GetChatResponse, _Mapping]] = ..., list_chats: _Optional[_Union[_chat_pb2.ListChatsResponse, _Mapping]] = ..., rename_chat: _Optional[_Union[_chat_pb2.RenameChatResponse, _Mapping]] = ..., delete_chat: _Optional[_Union[_chat_pb2.DeleteChatResponse, _Mapping]] = ..., list_messages: _Optional[_Union[_chat_pb2.ListMessagesResponse, _Mapping]] = ..., get_run: _Optional[_Union[_chat_pb2.GetRunResponse, _Mapping]] = ..., cancel_run: _Optional[_Union[_chat_pb2.CancelRunResponse, _Mapping]] = ..., list_models: _Optional[_Union[_chat_pb2.ListModelsResponse, _Mapping]] = ..., get_usage: _Optional[_Union[_chat_pb2.GetUsageResponse, _Mapping]] = ..., search_chats: _Optional[_Union[_chat_pb2.SearchChatsResponse, _Mapping]] = ..., get_branch: _Optional[_Union[_chat_pb2.GetBranchResponse, _Mapping]] = ..., set_chat_metadata: _Optional[_Union[_chat_pb2.SetChatMetadataResponse, _Mapping]] = ..., append_messages: _Optional[_Union[_chat_pb2.AppendMessagesResponse, _Mapping]] = ..., delete_message: _Optional[_Union[_chat_pb2.DeleteMessageResponse, _Mapping]] = ..., embed: _Optional[_Union[_chat_pb2.EmbedResponse, _Mapping]] = ...) -> None: ...

class CompleteFinished(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CompleteFailed(_message.Message):
    __slots__ = ("status",)
    STATUS_FIELD_NUMBER: _ClassVar[int]
    status: bytes
    def __init__(self, status: _Optional[bytes] = ...) -> None: ...
