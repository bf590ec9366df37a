"""ScriptedChatService: a real grpc.aio ChatService with scripted answers, for testing the front door.

It is NOT the orchestrator and tests that use it do not claim to test the orchestrator. It exists so the
edge's HTTP <-> gRPC mapping and Envoy's routing can be proven before (and independently of) the real
orchestrator: it keeps chats and runs in memory, answers with a fixed text token by token, keeps a run
going when its client detaches, replays a run from any sequence number, and records every call with its
metadata so tests can see exactly what reached it.

Scripts, in the text of a user message (SendMessage) or the last message (Complete):
    !tokens N MS          answer with N tokens, one every MS milliseconds (default: 12 tokens, 20 ms)
    !runerror CODE K      after K deltas, end the run with a RunError event (code, message, retry 2 s)
    !refusedonce CODE     SendMessage: the first run of an idempotency key (of the message's text, for a
                          send without one of the client's) ends with a RunError before any delta (retry 1 s), as the
                          engine's queue limit refuses a stored send; a retry is answered
    !abort CODE K         after K deltas, abort the RPC itself with CODE
    !degraded MODEL       answer as the router degrading a free request would: from MODEL, degraded
    !answer NAME MS       answer with the tokens registered as NAME (``answering(NAME, tokens)``), one
                          every MS milliseconds
    !tool NAME OUTCOME    before the answer, a tool step of NAME (arguments ``{"q": 1}``) that ends with
                          OUTCOME (a ToolOutcome's name without its prefix: OK, ERROR, ...), 0.5 s apart
Unary failures are injected with ``failing(method, code, ...)``; ``delay(method, seconds)`` slows one.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from google.rpc import error_details_pb2, status_pb2

from chatmesh.chat.v1 import chat_pb2, chat_pb2_grpc, completion_link_pb2, completion_link_pb2_grpc
from chatmesh.errors import STATUS_DETAILS_KEY, ServiceError, abort, from_status
from chatmesh.identity import AUTHORIZATION_HEADER, Identity, TokenVerifier, Unauthenticated
from chatmesh.linked_calls import UNARY_CALLS, linked_call, linked_reply, method_of
from edge.chat_client.linked_run import EDGE_KEY_PREFIX
from localmesh.dev_jwt import ISSUER
from meshkit.links import LinkMessages, ServedRequests
from meshkit.serving import GrpcServer, start_grpc_server
from tests.fixtures.identity import session_keys

MODEL = "scripted-model"
WORDS = [
    "Streaming",
    "answers",
    "arrive",
    "token",
    "by",
    "token",
    "through",
    "Envoy",
    "and",
    "the",
    "edge",
    "while",
    "the",
    "run",
    "keeps",
    "going",
    "even",
    "when",
    "the",
    "browser",
    "reloads",
    "the",
    "page",
    "and",
    "resumes",
    "from",
    "the",
    "last",
    "event",
    "it",
    "saw",
]


def scripted_token(i: int) -> str:
    """The text of a run's i-th token (from 0)."""
    return WORDS[i % len(WORDS)] + " "


def scripted_text(tokens: int) -> str:
    """The whole answer of a run of ``tokens`` tokens."""
    return "".join(scripted_token(i) for i in range(tokens))


def new_id() -> str:
    """A time-based UUID, as the orchestrator's ids are (the Responses API's ids are made from them)."""
    return str(uuid.uuid1())


def now() -> Timestamp:
    ts = Timestamp()
    ts.GetCurrentTime()
    return ts


@dataclass
class Script:
    tokens: int = 12
    interval_s: float = 0.02
    run_error: tuple[str, int] | None = None
    abort: tuple[grpc.StatusCode, int] | None = None
    degraded_to: str = ""
    refused_once: str = ""
    answer: str = ""
    tools: list[tuple[str, str]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Script:
        script = cls()
        words = text.split()
        for i, word in enumerate(words):
            args = words[i + 1 : i + 3]
            if word == "!tokens":
                script.tokens, script.interval_s = int(args[0]), int(args[1]) / 1000
            elif word == "!runerror":
                script.run_error = (args[0], int(args[1]))
            elif word == "!abort":
                script.abort = (grpc.StatusCode[args[0]], int(args[1]))
            elif word == "!degraded":
                script.degraded_to = args[0]
            elif word == "!refusedonce":
                script.refused_once = args[0]
            elif word == "!answer":
                script.answer, script.interval_s = args[0], int(args[1]) / 1000
            elif word == "!tool":
                script.tools.append((args[0], args[1]))
        return script


@dataclass
class Call:
    method: str
    request: object
    metadata: dict[str, str]
    at: float = field(default_factory=time.monotonic)


@dataclass
class Failure:
    code: grpc.StatusCode
    message: str
    retry_after_s: float | None = None
    error_reason: str | None = None
    bad_field: str | None = None
    # How many calls fail before the method works again (None: all of them, until the block ends).
    times: int | None = None
    # Fail as gRPC itself or a proxy would (no status details): a shed call, a reset stream.
    transport: bool = False


@dataclass
class Run:
    proto: chat_pb2.Run
    owner: str
    events: list[chat_pb2.RunEvent] = field(default_factory=list)
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)
    finished: bool = False
    task: asyncio.Task | None = None

    async def publish(self, **kind: object) -> None:
        async with self.changed:
            self.events.append(chat_pb2.RunEvent(seq=len(self.events) + 1, **kind))
            self.proto.last_seq = len(self.events)
            self.changed.notify_all()

    async def finish(self, status: int) -> None:
        async with self.changed:
            self.finished = True
            self.proto.status = status
            self.changed.notify_all()

    async def follow(self, after_seq: int) -> AsyncIterator[chat_pb2.RunEvent]:
        """Events with seq > after_seq, then live ones until the run ends."""
        position = after_seq
        while True:
            async with self.changed:
                await self.changed.wait_for(lambda seen=position: len(self.events) > seen or self.finished)
                pending = self.events[position:]
                done = self.finished
            for event in pending:
                position = event.seq
                yield event
            if done and position >= len(self.events):
                return


class ScriptedChatService(chat_pb2_grpc.ChatServiceServicer):
    def __init__(self, verifier: TokenVerifier | None = None) -> None:
        self.calls: list[Call] = []
        self.chats: dict[str, tuple[str, chat_pb2.Chat]] = {}
        self.messages: dict[str, list[chat_pb2.Message]] = {}
        self.runs: dict[str, Run] = {}
        self._failures: dict[str, Failure] = {}
        self._delays: dict[str, float] = {}
        self._answers: dict[str, list[str]] = {}
        # Idempotency keys (or texts, for sends without one) whose first run was refused (``!refusedonce``).
        self._refused_keys: set[str] = set()
        # It proves callers as the orchestrator does: with the session's keys (or ``verifier``'s, e.g. an
        # identity provider's), from the token alone.
        self._verifier = verifier or TokenVerifier(session_keys().jwks_path, ISSUER)

    # -- test controls (called from the test's thread; plain dict writes) --

    @contextlib.contextmanager
    def failing(
        self, method: str, code: grpc.StatusCode, message: str = "scripted failure", **kw
    ) -> Iterator[None]:
        self._failures[method] = Failure(code, message, **kw)
        try:
            yield
        finally:
            self._failures.pop(method, None)

    @contextlib.contextmanager
    def delay(self, method: str, seconds: float) -> Iterator[None]:
        self._delays[method] = seconds
        try:
            yield
        finally:
            self._delays.pop(method, None)

    @contextlib.contextmanager
    def answering(self, name: str, tokens: list[str]) -> Iterator[None]:
        """Runs whose message says ``!answer NAME MS`` answer with these tokens."""
        self._answers[name] = tokens
        try:
            yield
        finally:
            self._answers.pop(name, None)

    def calls_to(self, method: str) -> list[Call]:
        return [call for call in self.calls if call.method == method]

    # -- plumbing --

    async def _enter(self, method: str, request: object, context: grpc.aio.ServicerContext) -> Identity:
        metadata = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.calls.append(Call(method, request, metadata))
        if seconds := self._delays.get(method):
            await asyncio.sleep(seconds)
        if failure := self._failures.get(method):
            if failure.times is not None:
                failure.times -= 1
                if failure.times <= 0:
                    self._failures.pop(method, None)
            await self._fail(context, failure)
        try:
            return self._verifier.identity_from_metadata(context.invocation_metadata())
        except Unauthenticated as exc:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
            raise

    @staticmethod
    async def _fail(context: grpc.aio.ServicerContext, failure: Failure) -> None:
        if failure.transport:
            if isinstance(context, _LinkedCallContext):
                raise _LinkBreaks  # on a completion link only a broken stream is the transport's
            await context.abort(failure.code, failure.message)
        if failure.retry_after_s is not None:
            await abort(context, ServiceError(failure.code, failure.message, failure.retry_after_s))
        status = status_pb2.Status(code=failure.code.value[0], message=failure.message)
        if failure.error_reason:
            status.details.add().Pack(
                error_details_pb2.ErrorInfo(reason=failure.error_reason, domain="chatmesh")
            )
        if failure.bad_field:
            violation = error_details_pb2.BadRequest.FieldViolation(
                field=failure.bad_field, description=failure.message
            )
            status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[violation]))
        # Always the status trailer, as our services' ``abort`` sends it (a status without one is the
        # transport's, whose text the edge does not show).
        trailers = ((STATUS_DETAILS_KEY, status.SerializeToString()),)
        await context.abort(failure.code, failure.message, trailing_metadata=trailers)

    async def _chat(
        self, chat_id: str, identity: Identity, context: grpc.aio.ServicerContext
    ) -> chat_pb2.Chat:
        owner, chat = self.chats.get(chat_id, ("", None))
        if chat is None or owner != identity.user_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"chat {chat_id} not found")
        return chat

    async def _run(self, run_id: str, identity: Identity, context: grpc.aio.ServicerContext) -> Run:
        run = self.runs.get(run_id)
        if run is None or run.owner != identity.user_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"run {run_id} not found")
        return run

    def _start_run(
        self,
        identity: Identity,
        chat: chat_pb2.Chat | None,
        parent: chat_pb2.Message | None,
        prompt: str,
        options: chat_pb2.GenerationOptions,
        refused: str = "",
    ) -> Run:
        run = Run(
            proto=chat_pb2.Run(
                run_id=new_id(),
                chat_id=chat.chat_id if chat else "",
                status=chat_pb2.RUN_STATUS_IN_PROGRESS,
                assistant_message_id=new_id() if chat else "",
                create_time=now(),
            ),
            owner=identity.user_id,
        )
        self.runs[run.proto.run_id] = run
        if chat is not None:
            chat.active_run_id = run.proto.run_id
            chat.update_time.CopyFrom(now())
        run.task = asyncio.get_running_loop().create_task(
            self._generate(run, chat, parent, prompt, options, refused)
        )
        return run

    async def _generate(
        self,
        run: Run,
        chat: chat_pb2.Chat | None,
        parent: chat_pb2.Message | None,
        prompt: str,
        options: chat_pb2.GenerationOptions,
        refused: str = "",
    ) -> None:
        """The run itself: independent of any client, like the real orchestrator's. ``refused``: the
        code it ends with before its first delta."""
        script = Script.parse(prompt)
        started = chat_pb2.RunStarted(
            run_id=run.proto.run_id,
            chat_id=run.proto.chat_id,
            user_message_id=parent.message_id if parent and parent.role == chat_pb2.ROLE_USER else "",
            assistant_message_id=run.proto.assistant_message_id,
            model=script.degraded_to or options.model or MODEL,
            degraded=bool(script.degraded_to),
        )
        await run.publish(started=started)
        if refused:
            message = f"scripted {refused}: busy"
            await run.publish(error=chat_pb2.RunError(code=refused, message=message, retry_after_ms=1000))
            await run.finish(chat_pb2.RUN_STATUS_FAILED)
            return
        for number, (tool, outcome) in enumerate(script.tools):
            call_id = f"call-{number}"
            await run.publish(
                step_started=chat_pb2.ToolStepStarted(call_id=call_id, tool=tool, arguments='{"q": 1}')
            )
            await asyncio.sleep(0.5)
            result = chat_pb2.ToolStepResult(
                call_id=call_id,
                tool=tool,
                outcome=chat_pb2.ToolOutcome.Value(f"TOOL_OUTCOME_{outcome}"),
                text=f"<b>{tool}</b> said 4",
            )
            await run.publish(step_result=result)
        text: list[str] = []
        finish, status = chat_pb2.FINISH_REASON_STOP, chat_pb2.RUN_STATUS_COMPLETED
        if script.answer:
            tokens = self._answers[script.answer]
        else:
            tokens = [scripted_token(i) for i in range(script.tokens)]
        limit = min(len(tokens), options.max_tokens or len(tokens))
        try:
            for i in range(limit):
                if script.run_error and i == script.run_error[1]:
                    code = script.run_error[0]
                    await run.publish(
                        error=chat_pb2.RunError(code=code, message=f"scripted {code}", retry_after_ms=2000)
                    )
                    await run.finish(chat_pb2.RUN_STATUS_FAILED)
                    return
                await asyncio.sleep(script.interval_s)
                word = tokens[i]
                text.append(word)
                await run.publish(delta=chat_pb2.Delta(text=word, token_count=1))
            if limit < len(tokens):
                finish = chat_pb2.FINISH_REASON_LENGTH
        except asyncio.CancelledError:
            finish, status = chat_pb2.FINISH_REASON_CANCELLED, chat_pb2.RUN_STATUS_CANCELLED
        usage = chat_pb2.Usage(
            prompt_tokens=len(prompt.split()), cached_prompt_tokens=0, completion_tokens=len(text)
        )
        await run.publish(usage=usage)
        if chat is not None:
            answer = chat_pb2.Message(
                message_id=run.proto.assistant_message_id,
                chat_id=chat.chat_id,
                parent_id=parent.message_id if parent else "",
                role=chat_pb2.ROLE_ASSISTANT,
                content="".join(text),
                token_count=len(text),
                model=started.model,
                finish_reason=finish,
                create_time=now(),
                run_id=run.proto.run_id,
                usage=usage,
            )
            self.messages[chat.chat_id].append(answer)
            chat.active_run_id = ""
            chat.update_time.CopyFrom(now())
        await run.publish(
            done=chat_pb2.Done(finish_reason=finish, assistant_message_id=run.proto.assistant_message_id)
        )
        await run.finish(status)

    async def _stream(
        self,
        run: Run,
        after_seq: int,
        response_type: type,
        context: grpc.aio.ServicerContext,
        abort: tuple[grpc.StatusCode, int] | None = None,
    ) -> AsyncIterator:
        deltas = 0
        async for event in run.follow(after_seq):
            if abort and event.WhichOneof("kind") == "delta":
                if deltas == abort[1]:
                    await context.abort(abort[0], f"scripted {abort[0].name} mid-stream")
                deltas += 1
            yield response_type(event=event)

    # -- ChatService --

    async def CreateChat(self, request, context):
        identity = await self._enter("CreateChat", request, context)
        chat = chat_pb2.Chat(
            chat_id=new_id(), title=request.title or "New chat", create_time=now(), update_time=now()
        )
        self.chats[chat.chat_id] = (identity.user_id, chat)
        self.messages[chat.chat_id] = []
        return chat_pb2.CreateChatResponse(chat=chat)

    async def GetChat(self, request, context):
        identity = await self._enter("GetChat", request, context)
        return chat_pb2.GetChatResponse(chat=await self._chat(request.chat_id, identity, context))

    async def ListChats(self, request, context):
        identity = await self._enter("ListChats", request, context)
        mine = [chat for owner, chat in self.chats.values() if owner == identity.user_id]
        mine.sort(key=lambda c: (c.update_time.seconds, c.update_time.nanos), reverse=True)
        start = int(request.page_token or 0)
        size = request.page_size or 20
        page = mine[start : start + size]
        more = start + size < len(mine)
        return chat_pb2.ListChatsResponse(chats=page, next_page_token=str(start + size) if more else "")

    async def RenameChat(self, request, context):
        identity = await self._enter("RenameChat", request, context)
        chat = await self._chat(request.chat_id, identity, context)
        chat.title = request.title
        chat.update_time.CopyFrom(now())
        return chat_pb2.RenameChatResponse(chat=chat)

    async def DeleteChat(self, request, context):
        identity = await self._enter("DeleteChat", request, context)
        await self._chat(request.chat_id, identity, context)
        del self.chats[request.chat_id]
        return chat_pb2.DeleteChatResponse()

    async def ListMessages(self, request, context):
        identity = await self._enter("ListMessages", request, context)
        await self._chat(request.chat_id, identity, context)
        newest_first = list(reversed(self.messages[request.chat_id]))
        start = int(request.page_token or 0)
        size = request.page_size or 50
        more = start + size < len(newest_first)
        return chat_pb2.ListMessagesResponse(
            messages=newest_first[start : start + size], next_page_token=str(start + size) if more else ""
        )

    async def GetBranch(self, request, context):
        identity = await self._enter("GetBranch", request, context)
        await self._chat(request.chat_id, identity, context)
        history = self.messages[request.chat_id]
        by_id = {m.message_id: m for m in history}
        start = request.page_token or request.leaf_message_id or (history[-1].message_id if history else "")
        if start and start not in by_id:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"message {start} not found")
        children: dict[str, list[str]] = {}  # oldest first, as stored
        for message in history:
            children.setdefault(message.parent_id, []).append(message.message_id)
        if request.newest_leaf and not request.page_token:
            under = [start]
            for message in history:  # oldest first: a parent before its children
                if message.parent_id in under:
                    under.append(message.message_id)
            start = under[-1] if len(under) > 1 else start
        path, versions, size = [], [], request.page_size or 50
        while start and len(path) < size:
            path.append(by_id[start])
            siblings = children[by_id[start].parent_id]
            at = siblings.index(start)
            versions.append(
                chat_pb2.Versions(
                    count=len(siblings),
                    number=at + 1,
                    previous_id=siblings[at - 1] if at else "",
                    next_id=siblings[at + 1] if at + 1 < len(siblings) else "",
                )
            )
            start = by_id[start].parent_id
        return chat_pb2.GetBranchResponse(messages=path, next_page_token=start, versions=versions)

    async def SendMessage(self, request, context):
        identity = await self._enter("SendMessage", request, context)
        chat = await self._chat(request.chat_id, identity, context)
        history = self.messages[chat.chat_id]
        parent_id = request.parent_message_id or (history[-1].message_id if history else "")
        user_message = chat_pb2.Message(
            message_id=new_id(),
            chat_id=chat.chat_id,
            parent_id=parent_id,
            role=chat_pb2.ROLE_USER,
            content=request.content,
            token_count=len(request.content.split()),
            create_time=now(),
        )
        history.append(user_message)
        if chat.title == "New chat":
            chat.title = request.content[:40]
        script = Script.parse(request.content)
        refused = ""
        # A key the edge made is one HTTP request's own (its retry gets another): as good as none.
        client_key = "" if request.idempotency_key.startswith(EDGE_KEY_PREFIX) else request.idempotency_key
        refusal_key = client_key or f"text:{request.content}"
        if script.refused_once and refusal_key not in self._refused_keys:
            self._refused_keys.add(refusal_key)
            refused = script.refused_once
        run = self._start_run(identity, chat, user_message, request.content, request.options, refused)
        user_message.run_id = run.proto.run_id
        async for response in self._stream(run, 0, chat_pb2.SendMessageResponse, context, script.abort):
            yield response

    async def RegenerateMessage(self, request, context):
        identity = await self._enter("RegenerateMessage", request, context)
        chat = await self._chat(request.chat_id, identity, context)
        by_id = {m.message_id: m for m in self.messages[chat.chat_id]}
        answer = by_id.get(request.message_id)
        if answer is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"message {request.message_id} not found")
        if answer.role != chat_pb2.ROLE_ASSISTANT:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "only assistant messages can be regenerated"
            )
        question = by_id[answer.parent_id]
        run = self._start_run(identity, chat, question, question.content, request.options)
        async for response in self._stream(run, 0, chat_pb2.RegenerateMessageResponse, context):
            yield response

    async def StreamRun(self, request, context):
        identity = await self._enter("StreamRun", request, context)
        run = await self._run(request.run_id, identity, context)
        if request.after_seq > run.proto.last_seq and run.finished:
            await context.abort(
                grpc.StatusCode.OUT_OF_RANGE, f"run {request.run_id} has only {run.proto.last_seq} events"
            )
        async for response in self._stream(run, request.after_seq, chat_pb2.StreamRunResponse, context):
            yield response

    async def GetRun(self, request, context):
        identity = await self._enter("GetRun", request, context)
        return chat_pb2.GetRunResponse(run=(await self._run(request.run_id, identity, context)).proto)

    async def CancelRun(self, request, context):
        identity = await self._enter("CancelRun", request, context)
        run = await self._run(request.run_id, identity, context)
        if not run.finished and run.task is not None:
            run.task.cancel()
            async with run.changed:
                await run.changed.wait_for(lambda: run.finished)
        return chat_pb2.CancelRunResponse(run=run.proto)

    async def Complete(self, request, context):
        identity = await self._enter("Complete", request, context)
        if not request.messages:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "messages must not be empty")
        prompt = request.messages[-1].content
        run = self._start_run(identity, None, None, prompt, request.options)
        async for response in self._stream(
            run, 0, chat_pb2.CompleteResponse, context, Script.parse(prompt).abort
        ):
            yield response

    async def ListModels(self, request, context):
        await self._enter("ListModels", request, context)
        return chat_pb2.ListModelsResponse(
            models=[chat_pb2.Model(model_id=MODEL, context_length=8192, engines=1)]
        )

    async def GetUsage(self, request, context):
        identity = await self._enter("GetUsage", request, context)
        used = sum(
            m.usage.prompt_tokens + m.usage.completion_tokens
            for owner, chat in self.chats.values()
            if owner == identity.user_id
            for m in self.messages[chat.chat_id]
            if m.role == chat_pb2.ROLE_ASSISTANT
        )
        return chat_pb2.GetUsageResponse(tier=identity.tier, used_tokens=used, limit_tokens=1_000_000)


COMPLETION_LINK = LinkMessages.of(completion_link_pb2)


# In the metadata the scripted calls record for a request that came on a CompleteMany stream.
LINKED = ("x-scripted-via", "completion-link")


class _LinkBreaks(Exception):
    """A transport failure scripted for a request on a completion link: its stream breaks."""


class _Aborted(Exception):
    def __init__(self, error: ServiceError) -> None:
        self.error = error


class _LinkedCallContext:
    """The part of a call's context the scripted calls use, for a request on a CompleteMany stream: its
    metadata is the token and trace context its start carries, and an abort ends the request with its
    status (a failure scripted as the transport's is a status like any other here: on a real link only a
    broken stream is the transport's)."""

    def __init__(self, authorization: str, trace_context: Mapping[str, str]) -> None:
        self._metadata = ((AUTHORIZATION_HEADER, authorization), LINKED, *trace_context.items())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    async def abort(self, code: grpc.StatusCode, message: str, trailing_metadata=()) -> None:
        error = ServiceError(code, message)
        for key, value in trailing_metadata:
            if key == STATUS_DETAILS_KEY:
                error = from_status(value)
        raise _Aborted(error)


class ScriptedCompletionLink(completion_link_pb2_grpc.CompletionLinkServiceServicer):
    """CompleteMany over the scripted calls: each request is its call (Complete, the stored chat's
    SendMessage, RegenerateMessage or StreamRun, or a unary call), run with its start's token."""

    def __init__(self, service: ScriptedChatService) -> None:
        self._service = service
        self.draining = False
        self._streams: set[asyncio.Event] = set()  # wake-ups of the open CompleteMany calls

    def drain(self) -> None:
        """As an orchestrator that drains: a new stream is refused UNAVAILABLE before it is read, an
        open one ends once no request is left on it (its health stays SERVING: a proxy's checks have not
        seen the drain yet)."""
        self.draining = True
        for wake in self._streams:
            wake.set()

    async def CompleteMany(self, request_iterator, context):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: draining")
        served = _ScriptedCompletes(self._service, lambda: self.draining)
        async for message in served.serve(request_iterator, self._streams):
            yield message
        if served.broken:  # every request on it fails UNAVAILABLE, without status details
            await context.abort(grpc.StatusCode.UNAVAILABLE, "scripted: the completion link broke")


class _ScriptedCompletes(ServedRequests):
    def __init__(self, service: ScriptedChatService, draining: Callable[[], bool]) -> None:
        super().__init__(COMPLETION_LINK, lambda: self.broken or draining())
        self._service = service
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.broken = False

    def _break(self) -> None:
        """Ends the stream with an error: every request on it stops, and says nothing more."""
        self.broken = True
        for request_id in list(self._tasks):
            self._tasks.pop(request_id).cancel()
            self.end(request_id)
        self.news.set()

    def start(self, request_id: str, frame) -> None:
        self._tasks[request_id] = asyncio.create_task(self._complete(request_id, frame))

    def cancel(self, request_id: str) -> None:
        self._tasks[request_id].cancel()

    def stop(self, request_id: str) -> None:
        self._tasks.pop(request_id).cancel()

    async def _complete(self, request_id: str, frame) -> None:
        context = _LinkedCallContext(frame.start.authorization, frame.trace_context)
        _, request = linked_call(frame.start)
        method = method_of(request)
        call = getattr(self._service, method)
        error = None
        try:
            if method in UNARY_CALLS:
                reply = linked_reply(method, await call(request, context))
                self.send(COMPLETION_LINK.response_frame(request_id=request_id, reply=reply))
            else:
                async for response in call(request, context):
                    self.send(COMPLETION_LINK.response_frame(request_id=request_id, event=response.event))
        except _Aborted as aborted:
            error = aborted.error
        except _LinkBreaks:
            self._break()
            return
        except asyncio.CancelledError:
            error = ServiceError(grpc.StatusCode.CANCELLED, "the caller cancelled the request")
        self.finish(request_id, error)


class ScriptedChatServer:
    """Runs a ScriptedChatService on its own event loop thread, so sync and async tests can both use it."""

    def __init__(self, verifier: TokenVerifier | None = None) -> None:
        self.service = ScriptedChatService(verifier)
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="scripted-chat-service", daemon=True
        )
        self._server: GrpcServer | None = None
        self.completion_link = ScriptedCompletionLink(self.service)

    def start(self) -> ScriptedChatServer:
        self._thread.start()

        def add(server: grpc.aio.Server) -> list[str]:
            chat_pb2_grpc.add_ChatServiceServicer_to_server(self.service, server)
            completion_link_pb2_grpc.add_CompletionLinkServiceServicer_to_server(self.completion_link, server)
            return [
                chat_pb2.DESCRIPTOR.services_by_name["ChatService"].full_name,
                completion_link_pb2.DESCRIPTOR.services_by_name["CompletionLinkService"].full_name,
            ]

        self._server = asyncio.run_coroutine_threadsafe(start_grpc_server(add, 0), self._loop).result(30)
        self.port = self._server.port
        return self

    def drain_links(self) -> None:
        """Its completion links drain (``ScriptedCompletionLink.drain``), on its own loop."""
        self._loop.call_soon_threadsafe(self.completion_link.drain)

    def stop(self) -> None:
        """Stops serving (its port refuses connections from then on); once stopped, does nothing."""
        if not self._thread.is_alive():
            return
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.server.stop(0), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
