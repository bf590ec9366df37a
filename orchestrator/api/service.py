"""ChatService: each RPC is a few lines over memory_store, the kinds of run, and ``Runs``.

Every call needs a bearer token this replica verifies itself (``authorization`` metadata: the token
Envoy verified, forwarded by Envoy or the edge), else UNAUTHENTICATED; every chat and run is looked up under that user, so another user's is NOT_FOUND.
Errors become statuses in one place (``errors.from_exception``), with their details as trailers. A
client that cancels a streaming call of a stored chat only detaches: the run goes on (only CancelRun
stops it); a Complete whose client cancels is cancelled with it (nobody could resume it).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.message import Message

from chatmesh import limits
from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc
from chatmesh.errors import abort, invalid
from chatmesh.identity import Identity, TokenVerifier, Unauthenticated
from chatmesh.limits import Limits
from chatmesh.unknown_fields import unknown_field
from memory_store.chats import check_metadata
from memory_store.errors import InvalidArgument
from memory_store.store import MemoryStore
from meshkit.deadline import Deadline
from orchestrator import convert
from orchestrator.api.appends import append_messages
from orchestrator.embeddings import Embeddings
from orchestrator.errors import from_exception
from orchestrator.policy.admission import Budgets
from orchestrator.router_client import RouterClient
from orchestrator.runs.answer_run import AnswerRun
from orchestrator.runs.complete import CompleteRun
from orchestrator.runs.context import RunContext
from orchestrator.runs.regenerate import RegenerateRun
from orchestrator.runs.send import SendRun

# Unary calls without a client deadline get this one (every call ends, one way or another).
DEFAULT_UNARY_DEADLINE_S = 30.0
# A stream ends itself with DEADLINE_EXCEEDED this long before its deadline: left to the transport, the
# deadline resets the HTTP/2 stream, which a proxy in between (Envoy) turns into INTERNAL for the client.
DEADLINE_MARGIN_S = 0.1


# When the unary call being handled must have been answered (the loop's clock): a handler that would
# rather answer with what it has than not at all reads it (``_answer_within_s``).
_call_ends_at: contextvars.ContextVar[float] = contextvars.ContextVar("call_ends_at")
# The way back to a caller behind Envoy and the edge, through loops that may lag under load.
ANSWER_MARGIN_S = 0.5


def _answer_within_s() -> float:
    return max(0.0, _call_ends_at.get() - asyncio.get_running_loop().time() - ANSWER_MARGIN_S)


async def _identity(service: ChatService, context: grpc.aio.ServicerContext) -> Identity:
    try:
        return service.verifier.identity_from_metadata(context.invocation_metadata())
    except Unauthenticated as exc:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        raise  # abort raises; this line only tells the type checker


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await abort(context, from_exception(exc))


UnaryMethod = Callable[[Any, Identity, Any], Awaitable[Any]]
# ChatService's unary methods by name, as ``answer`` calls them (the ``unary`` handlers' own).
_UNARY_METHODS: dict[str, UnaryMethod] = {}


def unary(method: UnaryMethod):
    _UNARY_METHODS[method.__name__] = method

    @functools.wraps(method)
    async def handler(self: ChatService, request: Any, context: grpc.aio.ServicerContext) -> Any:
        identity = await _identity(self, context)
        try:
            return await self.answer(method.__name__, identity, request, context.time_remaining())
        except Exception as exc:
            await _abort(context, exc)

    return handler


RunStreamRequest = (
    chat_pb2.SendMessageRequest
    | chat_pb2.RegenerateMessageRequest
    | chat_pb2.CompleteRequest
    | chat_pb2.StreamRunRequest
)


def run_events(
    ctx: RunContext, identity: Identity, request: RunStreamRequest
) -> AsyncIterator[chat_pb2.RunEvent]:
    """The events of a run-event stream's request, as a call or on a completion link: a new run's
    (checked here: a refusal raises before any read or write) or, for StreamRun, an existing run's."""
    known_fields_only(request)
    if isinstance(request, chat_pb2.StreamRunRequest):
        limits.check_id(request.run_id, "run_id")
        return ctx.runs.reads.stream(
            identity.user_id, request.run_id, request.after_seq, request.merge_deltas
        )
    run: AnswerRun
    if isinstance(request, chat_pb2.SendMessageRequest):
        run = SendRun(ctx, identity, request)
    elif isinstance(request, chat_pb2.RegenerateMessageRequest):
        run = RegenerateRun(ctx, identity, request)
    else:
        run = CompleteRun(ctx, identity, request)
    return ctx.runs.starts.answer(run, request.merge_deltas)


def known_fields_only(request: Message) -> None:
    """Refuses a request carrying a field this server's protos do not define (a newer client's): what
    it asks for would otherwise be silently ignored."""
    if (found := unknown_field(request)) is not None:
        where, number = found
        raise invalid(
            where or "request",
            f"{where or 'the request'} carries field number {number}, which this server does not know "
            "(a client built from newer protos?); it is refused rather than ignored",
        )


def run_stream(response: type):
    """A run-event stream's handler: its request's events (``run_events``), each wrapped in ``response``."""

    async def handler(self: ChatService, request: Any, context: grpc.aio.ServicerContext):
        identity = await _identity(self, context)
        remaining = context.time_remaining()
        end = None if remaining is None else asyncio.get_running_loop().time() + remaining - DEADLINE_MARGIN_S
        try:
            events = run_events(self.ctx, identity, request)
            with Deadline(end) as deadline:
                while True:
                    event = await deadline.wait(anext(events))
                    yield response(event=event)
        except StopAsyncIteration:
            return
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                "the call's deadline passed; the run goes on: resume it with StreamRun(run_id, after_seq)",
            )
        except Exception as exc:
            await _abort(context, exc)

    return handler


class ChatService(chat_pb2_grpc.ChatServiceServicer):
    def __init__(
        self,
        ctx: RunContext,
        budgets: Budgets,
        router: RouterClient,
        verifier: TokenVerifier,
    ) -> None:
        self.ctx = ctx
        self.verifier = verifier
        self.store: MemoryStore = ctx.store
        self.runs = ctx.runs
        self.budgets = budgets
        self.router = router
        self.limits: Limits = ctx.config.limits
        self.embeddings = Embeddings(budgets, ctx.store, router)

    async def answer(self, method: str, identity: Identity, request: Any, within_s: float | None) -> Any:
        """The response of the unary call ``method`` for ``identity``, as a call or on a completion link:
        within the caller's time (``within_s``; at most ``DEFAULT_UNARY_DEADLINE_S``, which a call
        without a deadline gets), else TimeoutError."""
        known_fields_only(request)
        budget_s = min(within_s or DEFAULT_UNARY_DEADLINE_S, DEFAULT_UNARY_DEADLINE_S)
        _call_ends_at.set(asyncio.get_running_loop().time() + budget_s)
        async with asyncio.timeout(budget_s):
            return await _UNARY_METHODS[method](self, identity, request)

    # -- chats ----------------------------------------------------------------------------------

    @unary
    async def CreateChat(self, identity: Identity, request: chat_pb2.CreateChatRequest):
        limits.check_title(request.title, self.limits, allow_empty=True)
        limits.check_idempotency_key(request.idempotency_key, self.limits)
        if len(request.model) > self.limits.max_model_chars:
            raise invalid("model", f"model names have at most {self.limits.max_model_chars} characters")
        # A model named is one that takes chats (empty: the default model at each send).
        model = self.ctx.models.for_chat(request.model, field="model").name if request.model else ""
        metadata = _checked_metadata(request.metadata, self.store)
        chat = await self.store.create_chat(
            identity.user_id, request.title, request.idempotency_key, model, metadata
        )
        return chat_pb2.CreateChatResponse(chat=convert.chat(chat))

    @unary
    async def GetChat(self, identity: Identity, request: chat_pb2.GetChatRequest):
        limits.check_id(request.chat_id, "chat_id")
        chat = await self.store.get_chat(identity.user_id, request.chat_id)
        return chat_pb2.GetChatResponse(chat=convert.chat(chat))

    @unary
    async def ListChats(self, identity: Identity, request: chat_pb2.ListChatsRequest):
        size = limits.page_size(request.page_size, self.limits.default_chat_page, self.limits.max_chat_page)
        page = await self.store.list_chats(identity.user_id, request.page_token or None, size)
        return chat_pb2.ListChatsResponse(
            chats=[convert.chat(c) for c in page.items], next_page_token=page.next_cursor or ""
        )

    @unary
    async def SearchChats(self, identity: Identity, request: chat_pb2.SearchChatsRequest):
        limits.check_search_query(request.query, self.limits)
        size = limits.page_size(
            request.page_size, self.limits.default_search_page, self.limits.max_search_page
        )
        page = await self.store.search_chats(
            identity.user_id, request.query, request.page_token or None, size
        )
        return chat_pb2.SearchChatsResponse(
            hits=[convert.search_hit(h) for h in page.items], next_page_token=page.next_cursor or ""
        )

    @unary
    async def RenameChat(self, identity: Identity, request: chat_pb2.RenameChatRequest):
        limits.check_id(request.chat_id, "chat_id")
        limits.check_title(request.title, self.limits, allow_empty=False)
        chat = await self.store.rename_chat(identity.user_id, request.chat_id, request.title)
        return chat_pb2.RenameChatResponse(chat=convert.chat(chat))

    @unary
    async def SetChatMetadata(self, identity: Identity, request: chat_pb2.SetChatMetadataRequest):
        limits.check_id(request.chat_id, "chat_id")
        metadata = _checked_metadata(request.metadata, self.store)
        chat = await self.store.set_chat_metadata(identity.user_id, request.chat_id, metadata)
        return chat_pb2.SetChatMetadataResponse(chat=convert.chat(chat))

    @unary
    async def AppendMessages(self, identity: Identity, request: chat_pb2.AppendMessagesRequest):
        stored = await append_messages(self.ctx, identity, request)
        return chat_pb2.AppendMessagesResponse(messages=[convert.message(m) for m in stored])

    @unary
    async def DeleteMessage(self, identity: Identity, request: chat_pb2.DeleteMessageRequest):
        limits.check_id(request.chat_id, "chat_id")
        limits.check_id(request.message_id, "message_id")
        await self.store.delete_message(identity.user_id, request.chat_id, request.message_id)
        return chat_pb2.DeleteMessageResponse()

    @unary
    async def DeleteChat(self, identity: Identity, request: chat_pb2.DeleteChatRequest):
        limits.check_id(request.chat_id, "chat_id")
        await self.store.delete_chat(identity.user_id, request.chat_id)
        # Nobody can read the answer any more: free its engine work.
        self.runs.cancels.cancel_chat(identity.user_id, request.chat_id)
        return chat_pb2.DeleteChatResponse()

    @unary
    async def ListMessages(self, identity: Identity, request: chat_pb2.ListMessagesRequest):
        limits.check_id(request.chat_id, "chat_id")
        size = limits.page_size(
            request.page_size, self.limits.default_message_page, self.limits.max_message_page
        )
        page = await self.store.list_messages(
            identity.user_id, request.chat_id, before=request.page_token or None, limit=size
        )
        return chat_pb2.ListMessagesResponse(
            messages=[convert.message(m) for m in page.items], next_page_token=page.next_cursor or ""
        )

    @unary
    async def GetBranch(self, identity: Identity, request: chat_pb2.GetBranchRequest):
        limits.check_id(request.chat_id, "chat_id")
        if request.leaf_message_id:
            limits.check_id(request.leaf_message_id, "leaf_message_id")
        size = limits.page_size(
            request.page_size, self.limits.default_message_page, self.limits.max_message_page
        )
        page = await self.store.branch_page(
            identity.user_id,
            request.chat_id,
            request.leaf_message_id or None,
            request.page_token or None,
            size,
            newest_under=request.newest_leaf,
        )
        return chat_pb2.GetBranchResponse(
            messages=[convert.message(m) for m in page.items],
            next_page_token=page.next_cursor or "",
            versions=[
                chat_pb2.Versions(
                    count=v.count, number=v.number, previous_id=v.previous_id or "", next_id=v.next_id or ""
                )
                for v in page.versions
            ],
        )

    # -- answers --------------------------------------------------------------------------------

    # A run's request is checked when its object is made (a refusal costs no read or write); the
    # run then goes on as a task of this replica, and the call follows its events.

    SendMessage = run_stream(chat_pb2.SendMessageResponse)
    RegenerateMessage = run_stream(chat_pb2.RegenerateMessageResponse)
    Complete = run_stream(chat_pb2.CompleteResponse)
    StreamRun = run_stream(chat_pb2.StreamRunResponse)

    @unary
    async def GetRun(self, identity: Identity, request: chat_pb2.GetRunRequest):
        limits.check_id(request.run_id, "run_id")
        return chat_pb2.GetRunResponse(run=await self.runs.reads.get(identity.user_id, request.run_id))

    @unary
    async def CancelRun(self, identity: Identity, request: chat_pb2.CancelRunRequest):
        limits.check_id(request.run_id, "run_id")
        run = await self.runs.cancels.cancel(identity.user_id, request.run_id, _answer_within_s())
        return chat_pb2.CancelRunResponse(run=run)

    # -- models and usage -----------------------------------------------------------------------

    @unary
    async def ListModels(self, identity: Identity, request: chat_pb2.ListModelsRequest):
        """The served models that engines serve (a model no replica prompts for is refused, so it is not
        listed), with their kind and licence."""
        healthy: dict[str, int] = {}
        for engine in await self.router.list_engines():
            if engine.model in self.ctx.models.by_name:
                healthy[engine.model] = healthy.get(engine.model, 0) + int(engine.healthy)
        served = self.ctx.models.by_name
        return chat_pb2.ListModelsResponse(
            models=[
                chat_pb2.Model(
                    model_id=model,
                    context_length=served[model].context_window,
                    engines=count,
                    kind=served[model].kind,
                    licence=served[model].licence,
                )
                for model, count in sorted(healthy.items())
            ]
        )

    @unary
    async def Embed(self, identity: Identity, request: chat_pb2.EmbedRequest):
        return await self.embeddings.embed(identity, request, _answer_within_s())

    @unary
    async def GetUsage(self, identity: Identity, request: chat_pb2.GetUsageRequest):
        window = await self.budgets.window(identity.user_id)
        return chat_pb2.GetUsageResponse(
            tier=identity.tier,
            used_tokens=window.usage.total_tokens,
            limit_tokens=self.budgets.limit(identity.tier),
            window_start_time=convert.timestamp(window.start),
            window_end_time=convert.timestamp(window.end),
        )


def _checked_metadata(metadata: Mapping[str, str], store: MemoryStore) -> dict[str, str]:
    """A request's metadata, refused with INVALID_ARGUMENT naming ``metadata`` beyond its bounds."""
    try:
        check_metadata(metadata, store.bounds)
    except InvalidArgument as exc:
        raise invalid("metadata", str(exc)) from None
    return dict(metadata)
