"""Hostile input for the two doors (HTTP through Envoy to the edge, gRPC through Envoy to the
orchestrator), and the properties every answer must have. Shared by the bounded fuzz tests
(tests/front_door/test_mesh_fuzz.py) and the long run (bench/bench_fuzz.py).

A case is one request built by hypothesis: a route of the edge or a ChatService method, its path ids,
query, headers, token and body drawn from arbitrary JSON, mutations of a valid body (wrong types,
boundary and out-of-range numbers, unknown fields, missing fields), deep nesting, huge bodies, numbers of
thousands of digits, unicode edge cases (NUL, lone surrogates, "²") and malformed or expired JWTs.
``check_http`` / ``check_grpc`` send it and return what is wrong with the answer (nothing, for a pass):

- no 5xx, but 503 for capacity (it must then say when to retry); gRPC: no INTERNAL, UNKNOWN, DATA_LOSS;
- no traceback or internal name (module paths, addresses, engine ids, gRPC's own texts) in the answer,
  unless the request itself contained it (errors may quote what they refuse);
- every HTTP error in the door's documented shape: ``{"error": {"message", "type", ...}}``, 400 for
  validation errors with ``param`` naming a field on the edge's own refusals;
- a refused request stores nothing: the door's own chat is unchanged after a refused call on it.
"""

from __future__ import annotations

import json
import string
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from urllib.parse import quote

import grpc
import httpx
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

from chatmesh.chat.v1 import chat_pb2
from chatmesh.identity import CHAT_ID_HEADER, TIER_HEADER, USER_ID_HEADER

# -- what must never be in an answer -------------------------------------------------------------------

# Markers of internals: a traceback, our module paths and generated code, gRPC's and Python's own error
# texts, addresses, the engines' ids. Checked case-sensitively, and only when the request lacks them.
LEAK_MARKERS = (
    "Traceback",
    'File "',
    ".py",
    "_pb2",
    "Exception",
    "Error(",
    "RecursionError",
    "ValueError",
    "pydantic",
    "127.0.0.1",
    "ipv4:",
    "ipv6:",
    "localhost:",
    "engine-0",
    "engine-1",
    "grpc_status",
    "StatusCode.",
    "Socket closed",
    "failed to connect",
    "upstream connect error",
)
# A 503 is for capacity only, and always says when to retry.
CAPACITY_STATUS = 503
BAD_GRPC_CODES = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})


def leaks(answer: str, request: str) -> list[str]:
    return [marker for marker in LEAK_MARKERS if marker in answer and marker not in request]


# -- values ------------------------------------------------------------------------------------------------

# NUL, digits int() refuses ("²") or takes (Arabic-Indic, math double-struck), lone surrogates, bidi and BOM marks, the last code point.
UNICODE_EDGES = (
    "\x00",
    "²",
    "٣",
    "\ud800",
    "\udfff",
    "\u202e",
    "\ufeff",
    "\U0001d7d8",
    "\U0010ffff",
    "é",
    "\n",
    "\r\n",
)
# Integers at and past every width a field might be stored in, and Python's 4,300-digit int() limit.
BOUNDARY_INTS = (
    -1,
    0,
    1,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    -(2**63) - 1,
    10**100,
)


def edgy_text(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=max_size),
        st.lists(st.sampled_from(UNICODE_EDGES), min_size=1, max_size=6).map("".join),
        st.sampled_from(("", " ", "0", "-1", "1e3", "0x10", "²", "1²", "+5", " 7 ", "9" * 30, "9" * 5000)),
    )


def numbers() -> st.SearchStrategy[object]:
    return st.one_of(
        st.sampled_from(BOUNDARY_INTS),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.sampled_from((0.0, -0.0, 1e-320, 1.5, 2.000001, 1e308)),
    )


def json_values(max_leaves: int = 12) -> st.SearchStrategy[object]:
    scalars = st.one_of(st.none(), st.booleans(), numbers(), edgy_text())
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=4), st.dictionaries(edgy_text(12), children, max_size=4)
        ),
        max_leaves=max_leaves,
    )


def _dumps(value: object) -> bytes:
    # Lone surrogates are legal in JSON escapes (``ensure_ascii``), which is how hostile clients send them.
    return json.dumps(value, ensure_ascii=True).encode()


def _raw_number(digits: int) -> bytes:
    return b'{"content": "hi", "options": {"max_tokens": ' + b"9" * digits + b"}}"


def _deep(depth: int, opener: bytes, closer: bytes) -> bytes:
    return b'{"messages": ' + opener * depth + closer * depth + b"}"


@st.composite
def mutated(draw: st.DrawFn, valid: dict) -> bytes:
    """A valid body with one field replaced, removed, or an unknown one added, at any depth."""
    body = json.loads(json.dumps(valid))
    paths: list[tuple[object, object]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, child in node.items():
                paths.append((node, key))
                walk(child)
        elif isinstance(node, list):
            for i, child in enumerate(node):
                paths.append((node, i))
                walk(child)

    walk(body)
    parent, key = draw(st.sampled_from(paths))
    how = draw(st.sampled_from(("replace", "replace", "remove", "add")))
    if how == "replace":
        parent[key] = draw(json_values())  # type: ignore[index]
    elif how == "remove":
        del parent[key]  # type: ignore[arg-type]
    elif isinstance(parent, dict):
        parent[draw(edgy_text(12))] = draw(json_values(4))
    return _dumps(body)


def bodies(valid: dict) -> st.SearchStrategy[bytes]:
    return st.one_of(
        mutated(valid),
        mutated(valid),
        json_values().map(_dumps),
        st.sampled_from((10, 4300, 4301, 5000, 20000)).map(_raw_number),
        st.tuples(
            st.sampled_from((33, 1000, 5000, 30000)), st.sampled_from(((b"[", b"]"), (b'{"a":', b"}")))
        ).map(lambda spec: _deep(spec[0], *spec[1])),
        st.binary(max_size=64),
        st.sampled_from(
            (
                b"",
                b"   ",
                b"null",
                b"[]",
                b'"just a string"',
                b'{"content": NaN}',
                b'{"content": Infinity}',
                b'{"content": "\\ud800"}',
                b'{"content": "a\\u0000b"}',
                b'{"content": "hi"',
                b'{"content": "hi"}}',
                b"\xff\xfe{}",
                b"x" * (70 * 1024),
                b'{"content": "' + b"x" * (70 * 1024) + b'"}',
            )
        ),
    )


# -- HTTP cases --------------------------------------------------------------------------------------------

VALID_SEND = {"content": "hi", "options": {"max_tokens": 2, "temperature": 0.5, "stop": ["x"], "seed": 1}}
VALID_COMPLETION = {
    "model": "",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    "max_tokens": 2,
    "temperature": 0.5,
    "stop": ["x"],
    "stream": False,
}
# Each route of the edge: method, path template, the valid body its mutations start from (None: no body).
ROUTES: tuple[tuple[str, str, dict | None], ...] = (
    ("GET", "/healthz", None),
    ("GET", "/v1/me", None),
    ("GET", "/v1/usage", None),
    ("GET", "/v1/chats", None),
    ("POST", "/v1/chats", {"title": "t"}),
    ("GET", "/v1/chats/{chat}", None),
    ("PATCH", "/v1/chats/{chat}", {"title": "t"}),
    ("DELETE", "/v1/chats/{chat}", None),
    ("GET", "/v1/chats/{chat}/messages", None),
    ("POST", "/v1/chats/{chat}/messages", VALID_SEND),
    ("POST", "/v1/chats/{chat}/messages/{message}/regenerate", {"options": {"max_tokens": 2}}),
    ("GET", "/v1/runs/{run}", None),
    ("GET", "/v1/runs/{run}/events", None),
    ("POST", "/v1/runs/{run}/cancel", None),
    ("POST", "/v1/chat/completions", VALID_COMPLETION),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/{model}", None),
)
METHODS = ("GET", "POST", "PATCH", "DELETE", "PUT")


@dataclass(frozen=True)
class Ids:
    """What the fuzzer's own user owns, so cases reach past "not found" (and a refused one can be seen
    to have stored nothing)."""

    user: str
    chat: str
    message: str
    run: str
    model: str


def own_ids(url: str, mint: Callable[..., str]) -> Ids:
    """A new user with a chat holding one exchange: real ids for the cases to aim at."""
    user = f"fuzz-{uuid.uuid4().hex[:8]}"
    auth = {"authorization": f"Bearer {mint(user, 'enterprise')}"}
    with httpx.Client(base_url=url, headers=auth, timeout=30) as client:
        chat = client.post("/v1/chats", json={"title": "fuzzed"}).json()["chat_id"]
        body = {"content": "hello", "options": {"max_tokens": 2}}
        with client.stream("POST", f"/v1/chats/{chat}/messages", json=body) as reply:
            started = next(line for line in reply.iter_lines() if line.startswith("data:"))
        run = json.loads(started.removeprefix("data:"))
        [model] = [m["id"] for m in client.get("/v1/models").json()["data"]]
    return Ids(user, chat, run["assistant_message_id"], run["run_id"], model)


@dataclass(frozen=True)
class HttpCase:
    method: str
    route: str
    path: str
    headers: tuple[tuple[str, str], ...]
    query: tuple[tuple[str, str], ...]
    body: bytes | None
    # Whose token: "owner" (the door's user), "stranger", "expired", "garbage", "none", "other-audience".
    token: str
    on_own_chat: bool

    def text(self) -> str:
        return f"{self.method} {self.path} {self.query} {self.headers} {self.body!r}"


def _path_id(kind: str, ids: Ids) -> st.SearchStrategy[tuple[str, bool]]:
    own = getattr(ids, kind)
    return st.one_of(
        st.just((own, True)),
        st.just((own, True)),
        edgy_text(30).map(lambda text: (_escaped(text), False)),
        st.sampled_from((("..", False), ("%2e%2e", False), ("a" * 300, False), ("%00", False))),
    )


def _escaped(text: str) -> str:
    # Lone surrogates go out as the (invalid) UTF-8 a hostile client would send for them.
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _header_text() -> st.SearchStrategy[str]:
    # What an HTTP client can put in a header: printable Latin-1, no CR/LF, no surrounding blanks.
    return st.one_of(
        st.text(
            st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
        ),
        st.sampled_from(("²", "-1", "18446744073709551616", "9" * 5000, "0x1", "1.5", "")),
    ).map(lambda value: value.strip(" \t"))


@st.composite
def http_cases(draw: st.DrawFn, ids: Ids) -> HttpCase:
    method, template, valid = draw(st.sampled_from(ROUTES))
    if draw(st.integers(0, 19)) == 0:
        method = draw(st.sampled_from(METHODS))  # a method the route does not take
    path, on_own_chat = template, False
    for kind in ("chat", "message", "run", "model"):
        if "{" + kind + "}" in path:
            value, own = draw(_path_id(kind, ids))
            if own and method == "DELETE":
                # The fuzzer's chat must live on for its cases (and to show refusals store nothing).
                value, own = "a-chat-of-nobody", False
            path = path.replace("{" + kind + "}", value)
            on_own_chat = on_own_chat or (own and kind == "chat")
    headers: list[tuple[str, str]] = []
    for name in draw(
        st.lists(
            st.sampled_from(
                (
                    "last-event-id",
                    "idempotency-key",
                    "content-type",
                    CHAT_ID_HEADER,
                    USER_ID_HEADER,
                    TIER_HEADER,
                )
            ),
            unique=True,
            max_size=3,
        )
    ):
        value = draw(
            st.sampled_from(("text/plain", "application/json; charset=latin-1", "multipart/form-data"))
            if name == "content-type" and draw(st.booleans())
            else _header_text()
        )
        headers.append((name, value))
    query = tuple(
        draw(
            st.lists(
                st.tuples(
                    st.sampled_from(("page_size", "page_token", "after_seq", "chat_id", "x")), edgy_text(20)
                ),
                max_size=3,
            )
        )
    )
    body = draw(bodies(valid)) if valid is not None and method in ("POST", "PATCH", "PUT") else None
    token = draw(
        st.sampled_from(("owner",) * 6 + ("stranger", "expired", "garbage", "none", "other-audience"))
    )
    return HttpCase(method, template, path, tuple(headers), query, body, token, on_own_chat)


@dataclass
class HttpDoor:
    """The HTTP door as the fuzzer uses it: one client, tokens on demand, the fuzzer's own chat."""

    url: str
    mint: Callable[..., str]
    ids: Ids
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    def authorization(self, token: str) -> dict[str, str]:
        if token == "none":
            return {}
        if token == "garbage":
            return {"authorization": "Bearer not.a.jwt"}
        user = self.ids.user if token == "owner" else f"fuzz-stranger-{uuid.uuid4().hex[:8]}"
        if token == "expired":
            return {"authorization": f"Bearer {self.mint(user, 'enterprise', ttl_s=-60)}"}
        if token == "other-audience":
            return {"authorization": f"Bearer {self.mint(user, 'enterprise', audience='someone-else')}"}
        return {"authorization": f"Bearer {self.mint(user, 'enterprise')}"}

    def own_chat(self) -> tuple[object, ...]:
        auth = self.authorization("owner")
        chat = self.client.get(f"/v1/chats/{self.ids.chat}", headers=auth).json()
        messages = self.client.get(f"/v1/chats/{self.ids.chat}/messages", headers=auth).json()
        return chat.get("title"), chat.get("update_time"), json.dumps(messages, sort_keys=True)


@dataclass
class Outcome:
    label: str  # e.g. "POST /v1/chats/{chat}/messages 400"
    problems: list[str]


def check_http(door: HttpDoor, case: HttpCase) -> Outcome:
    before = door.own_chat() if case.on_own_chat and case.method != "GET" else None
    # Header values as raw Latin-1 bytes: what a client may put on the wire, not only ASCII.
    headers = [
        (name.encode(), value.encode("latin-1"))
        for name, value in {**door.authorization(case.token), **dict(case.headers)}.items()
    ]
    query = "&".join(f"{_escaped(name)}={_escaped(value)}" for name, value in case.query)
    url = f"{case.path}?{query}" if query else case.path
    request = door.client.build_request(case.method, url, headers=headers, content=case.body)
    try:
        reply = door.client.send(request, stream=True)
    except httpx.LocalProtocolError:
        return Outcome("not sendable by an HTTP client", [])
    except httpx.TransportError as exc:
        return Outcome(f"{case.method} {case.route} no answer", [f"no HTTP answer: {exc!r}"])
    try:
        head = b""
        for chunk in reply.iter_bytes():
            head += chunk
            # An accepted stream is not read to its end: its first event is enough here.
            if reply.headers.get("content-type", "").startswith("text/event-stream") and b"\n\n" in head:
                break
            if len(head) > 256 * 1024:
                break
    finally:
        reply.close()
    status = reply.status_code
    problems = _http_problems(case, status, reply.headers, head)
    if before is not None and status >= 400 and door.own_chat() != before:
        problems.append(f"refused with {status} but the chat changed")
    return Outcome(f"{case.method} {case.route} {status}", problems)


def _http_problems(case: HttpCase, status: int, headers: httpx.Headers, head: bytes) -> list[str]:
    problems = []
    text = head.decode("utf-8", "replace")
    if status >= 500 and status != CAPACITY_STATUS:
        problems.append(f"status {status}")
    if status == CAPACITY_STATUS and "retry-after" not in headers:
        problems.append("503 without Retry-After")
    problems += [f"leaks {marker!r}" for marker in leaks(text, case.text())]
    if status < 400:
        return problems
    try:
        error = json.loads(text)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return [*problems, f"{status} not in the error shape: {text[:200]!r}"]
    if status == 422:
        problems.append("422: validation errors are 400 invalid_request_error")
    if (
        error["type"] == "invalid_request_error"
        and error.get("code") == "invalid_value"
        and not error.get("param")
    ):
        problems.append("a validation error without param")
    return problems


# -- gRPC cases --------------------------------------------------------------------------------------------

# Every ChatService method with its request type, and whether it streams.
GRPC_METHODS: tuple[tuple[str, type[Message], bool], ...] = (
    ("CreateChat", chat_pb2.CreateChatRequest, False),
    ("GetChat", chat_pb2.GetChatRequest, False),
    ("ListChats", chat_pb2.ListChatsRequest, False),
    ("RenameChat", chat_pb2.RenameChatRequest, False),
    ("DeleteChat", chat_pb2.DeleteChatRequest, False),
    ("ListMessages", chat_pb2.ListMessagesRequest, False),
    ("SendMessage", chat_pb2.SendMessageRequest, True),
    ("RegenerateMessage", chat_pb2.RegenerateMessageRequest, True),
    ("StreamRun", chat_pb2.StreamRunRequest, True),
    ("GetRun", chat_pb2.GetRunRequest, False),
    ("CancelRun", chat_pb2.CancelRunRequest, False),
    ("Complete", chat_pb2.CompleteRequest, True),
    ("ListModels", chat_pb2.ListModelsRequest, False),
    ("GetUsage", chat_pb2.GetUsageRequest, False),
)


def _proto_text(ids: Ids, name: str) -> st.SearchStrategy[str]:
    own = {
        "chat_id": ids.chat,
        "message_id": ids.message,
        "parent_message_id": ids.message,
        "run_id": ids.run,
    }
    valid_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)  # protobuf needs UTF-8
    choices = [valid_text, st.sampled_from(("", " ", "\x00", "²", "a" * 300, "x" * 40000))]
    if name in own:
        choices += [st.just(own[name])] * 2
    return st.one_of(*choices)


@st.composite
def proto_messages(draw: st.DrawFn, kind: type[Message], ids: Ids, depth: int = 0) -> Message:
    """A ``kind`` with each field set or not, drawn over its whole range (nested messages a few levels)."""
    message = kind()
    for fd in kind.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        repeated = fd.is_repeated
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for _ in range(draw(st.integers(0, 5))):  # the maps of ChatService requests hold scalars
                getattr(message, fd.name)[_scalar(draw, key_fd, ids)] = _scalar(draw, value_fd, ids)
            continue
        for _ in range(draw(st.integers(0, 5)) if repeated else 1):
            target = getattr(message, fd.name)
            if fd.message_type is not None:
                if depth < 2 and not fd.message_type.full_name.startswith("google."):
                    sub = draw(proto_messages(GetMessageClass(fd.message_type), ids, depth + 1))
                    (target.add() if repeated else target).CopyFrom(sub)
            elif repeated:
                target.append(_scalar(draw, fd, ids))
            else:
                setattr(message, fd.name, _scalar(draw, fd, ids))
    return message


_INT_RANGES = {
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1),
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_ENUM: (-5, 10),  # past the defined values too
}


def _scalar(draw: st.DrawFn, fd: FieldDescriptor, ids: Ids) -> object:
    if fd.type == FieldDescriptor.TYPE_STRING:
        return draw(_proto_text(ids, fd.name))
    if fd.type == FieldDescriptor.TYPE_BOOL:
        return draw(st.booleans())
    if fd.type in _INT_RANGES:
        low, high = _INT_RANGES[fd.type]
        return draw(st.one_of(st.sampled_from((low, 0, 1, high)), st.integers(low, high)))
    if fd.type == FieldDescriptor.TYPE_FLOAT:
        return draw(st.floats(width=32))
    if fd.type == FieldDescriptor.TYPE_DOUBLE:
        return draw(st.floats())
    return draw(st.binary(max_size=16))


@dataclass(frozen=True)
class GrpcCase:
    method: str
    streaming: bool
    request: bytes
    token: str
    metadata: tuple[tuple[str, str], ...]

    def text(self) -> str:
        return f"{self.method} {self.metadata} {self.request!r}"


@st.composite
def grpc_cases(draw: st.DrawFn, ids: Ids) -> GrpcCase:
    method, kind, streaming = draw(st.sampled_from(GRPC_METHODS))
    if method == "DeleteChat":
        ids = replace(ids, chat="a-chat-of-nobody")  # the fuzzer's chat must live on for its cases
    # Mostly well-formed messages with hostile values; sometimes bytes that are no message at all.
    request = draw(
        st.one_of(
            proto_messages(kind, ids).map(lambda m: m.SerializeToString()),
            proto_messages(kind, ids).map(lambda m: m.SerializeToString()),
            st.binary(max_size=64),
        )
    )
    metadata = tuple(
        draw(
            st.lists(
                st.tuples(
                    st.sampled_from((CHAT_ID_HEADER, USER_ID_HEADER, TIER_HEADER, "grpc-timeout", "x-fuzz")),
                    st.text(alphabet=string.printable.strip(), max_size=30),
                ),
                unique_by=lambda pair: pair[0],
                max_size=2,
            )
        )
    )
    token = draw(st.sampled_from(("owner",) * 6 + ("stranger", "expired", "garbage", "none")))
    return GrpcCase(method, streaming, request, token, metadata)


@dataclass
class GrpcDoor:
    target: str
    http: HttpDoor
    channel: grpc.Channel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.target)

    def call(self, case: GrpcCase) -> tuple[grpc.StatusCode, str]:
        path = f"/chatmesh.chat.v1.ChatService/{case.method}"
        auth = self.http.authorization(case.token)
        metadata = tuple(auth.items()) + case.metadata
        identity = bytes  # requests are sent as the bytes drawn; answers are not decoded
        try:
            if case.streaming:
                stream = self.channel.unary_stream(
                    path, request_serializer=identity, response_deserializer=identity
                )
                call = stream(case.request, metadata=metadata, timeout=10)
                next(iter(call), None)  # the first event is enough; the run goes on
                call.cancel()
            else:
                unary = self.channel.unary_unary(
                    path, request_serializer=identity, response_deserializer=identity
                )
                unary(case.request, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED:
                return grpc.StatusCode.OK, ""
            return exc.code(), exc.details() or ""
        return grpc.StatusCode.OK, ""


def check_grpc(door: GrpcDoor, case: GrpcCase) -> Outcome:
    code, details = door.call(case)
    problems = []
    if code in BAD_GRPC_CODES:
        problems.append(f"{code.name}: {details}")
    problems += [f"leaks {marker!r}" for marker in leaks(details, case.text())]
    return Outcome(f"{case.method} {code.name}", problems)


@dataclass
class Tally:
    """Cases by outcome, and the failing ones (the first two of each outcome, with their problems)."""

    counts: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def record(self, outcome: Outcome, case: object) -> None:
        self.counts[outcome.label] += 1
        if outcome.problems:
            self.failed[outcome.label] += 1
            if self.failed[outcome.label] <= 2:
                self.failures.append(f"{outcome.label}: {outcome.problems} <- {str(case)[:400]}")

    @property
    def cases(self) -> int:
        return self.counts.total()

    @property
    def failed_cases(self) -> int:
        return self.failed.total()
