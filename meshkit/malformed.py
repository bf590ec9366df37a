"""Requests whose bytes are not the method's message: INVALID_ARGUMENT, for every server, in one place.

Left to grpcio, a request that does not parse (corrupt wire format, a string field that is not UTF-8)
ends the call UNKNOWN with "Unexpected <class 'google.protobuf.message.DecodeError'>: ...": a server
error naming our internals, for what is the caller's mistake. ``RejectMalformed`` gives each unary-request
method a deserializer that cannot raise; its handler refuses what did not parse before the service sees
it. (Methods that take a stream of requests keep grpcio's behaviour: no public method does.)
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Malformed:
    """What a deserializer returns for bytes that are not its message."""


MALFORMED = _Malformed()


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            return MALFORMED

    return deserialize


def _refusal(method: str) -> str:
    return f"the request is not a valid {method.rsplit('/', 1)[-1]} request message (malformed protobuf)"


async def _refuse(context: grpc.aio.ServicerContext, method: str) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _refusal(method))


class RejectMalformed(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or handler.request_streaming:
            return handler
        method = handler_call_details.method
        deserializer = _tolerant(handler.request_deserializer)
        if handler.unary_unary is not None and inspect.iscoroutinefunction(handler.unary_unary):
            unary: Any = handler.unary_unary

            async def checked_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if request is MALFORMED:
                    await _refuse(context, method)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                checked_unary, deserializer, handler.response_serializer
            )
        stream: Any = handler.unary_stream
        if stream is not None and inspect.isasyncgenfunction(stream):

            async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if request is MALFORMED:
                    await _refuse(context, method)
                async for response in stream(request, context):
                    yield response

            return grpc.unary_stream_rpc_method_handler(
                checked_stream, deserializer, handler.response_serializer
            )
        if stream is not None and inspect.iscoroutinefunction(stream):  # a stream written with context.write

            async def checked_writer(request: Any, context: grpc.aio.ServicerContext) -> None:
                if request is MALFORMED:
                    await _refuse(context, method)
                await stream(request, context)

            return grpc.unary_stream_rpc_method_handler(
                checked_writer, deserializer, handler.response_serializer
            )
        return handler
