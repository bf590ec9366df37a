from chatmesh.engine.v1 import engine_pb2 as _engine_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_FREE: _ClassVar[Tier]
    TIER_PRO: _ClassVar[Tier]
    TIER_ENTERPRISE: _ClassVar[Tier]
TIER_UNSPECIFIED: Tier
TIER_FREE: Tier
TIER_PRO: Tier
TIER_ENTERPRISE: Tier

class GenerateStart(_message.Message):
    __slots__ = ("request_id", "model", "prompt_token_ids", "sampling", "tier", "session_id", "tokenizer_fingerprint", "resumed_output_token_ids", "new_session")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_OUTPUT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_SESSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _engine_pb2.SamplingParams
    tier: Tier
    session_id: str
    tokenizer_fingerprint: str
    resumed_output_token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_session: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_engine_pb2.SamplingParams, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ..., session_id: _Optional[str] = ..., tokenizer_fingerprint: _Optional[str] = ..., resumed_output_token_ids: _Optional[_Iterable[int]] = ..., new_session: _Optional[bool] = ...) -> None: ...

class GenerateCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GenerateRouted(_message.Message):
    __slots__ = ("engine_id", "predicted_cached_tokens", "attempt", "model", "degraded")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DEGRADED_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    predicted_cached_tokens: int
    attempt: int
    model: str
    degraded: bool
    def __init__(self, engine_id: _Optional[str] = ..., predicted_cached_tokens: _Optional[int] = ..., attempt: _Optional[int] = ..., model: _Optional[str] = ..., degraded: _Optional[bool] = ...) -> None: ...

class GenerateManyRequest(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[RequestFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[RequestFrame, _Mapping]]] = ...) -> None: ...

class RequestFrame(_message.Message):
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
    start: GenerateStart
    cancel: GenerateCancel
    trace_context: _containers.ScalarMap[str, str]
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., start: _Optional[_Union[GenerateStart, _Mapping]] = ..., cancel: _Optional[_Union[GenerateCancel, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class GenerateManyResponse(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[ResponseFrame]
    def __init__(self, frames: _Optional[_Iterable[_Union[ResponseFrame, _Mapping]]] = ...) -> None: ...

class ResponseFrame(_message.Message):
    __slots__ = ("request_id", "routed", "tokens", "finished", "failed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    routed: GenerateRouted
    tokens: _engine_pb2.GenerateTokens
    finished: _engine_pb2.GenerateFinished
    failed: _engine_pb2.GenerateFailed
    def __init__(self, request_id: _Optional[str] = ..., routed: _Optional[_Union[GenerateRouted, _Mapping]] = ..., tokens: _Optional[_Union[_engine_pb2.GenerateTokens, _Mapping]] = ..., finished: _Optional[_Union[_engine_pb2.GenerateFinished, _Mapping]] = ..., failed: _Optional[_Union[_engine_pb2.GenerateFailed, _Mapping]] = ...) -> None: ...

class ListEnginesRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class EngineStatus(_message.Message):
    __slots__ = ("engine_id", "address", "model", "healthy", "load", "indexed_blocks", "backend", "inflight_requests", "sessions_held")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    INDEXED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_HELD_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    address: str
    model: str
    healthy: bool
    load: _engine_pb2.EngineLoad
    indexed_blocks: int
    backend: str
    inflight_requests: int
    sessions_held: int
    def __init__(self, engine_id: _Optional[str] = ..., address: _Optional[str] = ..., model: _Optional[str] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[_engine_pb2.EngineLoad, _Mapping]] = ..., indexed_blocks: _Optional[int] = ..., backend: _Optional[str] = ..., inflight_requests: _Optional[int] = ..., sessions_held: _Optional[int] = ...) -> None: ...

class ListEnginesResponse(_message.Message):
    __slots__ = ("engines",)
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    engines: _containers.RepeatedCompositeFieldContainer[EngineStatus]
    def __init__(self, engines: _Optional[_Iterable[_Union[EngineStatus, _Mapping]]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("embed", "tier")
    EMBED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    embed: _engine_pb2.EmbedRequest
    tier: Tier
    def __init__(self, embed: _Optional[_Union[_engine_pb2.EmbedRequest, _Mapping]] = ..., tier: _Optional[_Union[Tier, str]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embed", "engine_id")
    EMBED_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    embed: _engine_pb2.EmbedResponse
    engine_id: str
    def __init__(self, embed: _Optional[_Union[_engine_pb2.EmbedResponse, _Mapping]] = ..., engine_id: _Optional[str] = ...) -> None: ...
