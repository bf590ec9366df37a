"""Engine outputs on their way to gRPC streams: from the step thread onto the event loop.

The step thread hands over each step's outputs in one call (``OutputDispatcher.submit``); at most one
delivery is ever scheduled on the event loop, however far behind the loop is. On the loop, each
request's ``RequestStream`` merges the frames its client has not read yet into one, so a slow reader
costs memory in proportion to its own output (bounded by max_tokens) and never slows the engine. The
merged frame keeps each token's text boundary (``text_ends``), so a reader can split it back into the
pieces the steps released (``chatmesh/token_text.py``). A stream tells its reader it has news through
a callback: a ``GenerateMany`` call collects those of all of its requests and sends them in one
message.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable

from chatmesh.engine.v1 import engine_pb2
from engine.logprobs import TokenLogprob
from engine.outputs import Finish, RequestOutput


class RequestStream:
    """What one request's client has not been sent yet."""

    def __init__(
        self,
        request_id: str,
        on_news: Callable[[RequestStream], None],
        token_bytes: Callable[[int], bytes] = lambda token_id: b"",
    ) -> None:
        self.request_id = request_id
        self._on_news = on_news
        self._token_bytes = token_bytes
        self._logprobs: list[engine_pb2.TokenLogprob] = []
        self._index = 0
        self._token_ids: list[int] = []
        self._text: list[str] = []
        self._text_ends: list[int] = []  # into the joined text: each push's ends shifted by what was buffered
        self._text_length = 0
        self._finish: Finish | None = None

    def push(self, output: RequestOutput) -> None:
        if output.token_ids:
            if not self._token_ids:
                self._index = output.index
            self._token_ids += output.token_ids
            self._text.append(output.text)
            self._text_ends += [self._text_length + end for end in output.text_ends]
            self._text_length += len(output.text)
            self._logprobs += [self._logprob_proto(logprob) for logprob in output.logprobs]
        if output.finish is not None:
            self._finish = output.finish
        self._on_news(self)

    def take(self) -> tuple[engine_pb2.GenerateTokens | None, Finish | None]:
        """All tokens not yet sent as one frame (None if there are none), and the finish if it came."""
        tokens = None
        if self._token_ids:
            tokens = engine_pb2.GenerateTokens(
                index=self._index,
                token_ids=self._token_ids,
                text="".join(self._text),
                text_ends=self._text_ends,
                logprobs=self._logprobs,
            )
            self._token_ids, self._text, self._text_ends, self._text_length = [], [], [], 0
            self._logprobs = []
        return tokens, self._finish

    def _logprob_proto(self, logprob: TokenLogprob) -> engine_pb2.TokenLogprob:
        return engine_pb2.TokenLogprob(
            token_id=logprob.token_id,
            token_bytes=self._token_bytes(logprob.token_id),
            logprob=logprob.logprob,
            top=[
                engine_pb2.TokenLogprob(token_id=token, token_bytes=self._token_bytes(token), logprob=value)
                for token, value in logprob.top
            ],
        )


class OutputDispatcher:
    """Hands each step's outputs to the streams of their requests."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        on_error: Callable[[str], None] | None = None,
        token_bytes: Callable[[int], bytes] = lambda token_id: b"",
    ) -> None:
        self._loop = loop
        self._token_bytes = token_bytes  # for the logprobs a request asked for
        self._on_error = on_error or (lambda message: None)
        self._lock = threading.Lock()
        self._pending: list[RequestOutput] = []
        self._streams: dict[str, RequestStream] = {}

    def open(self, request_id: str, on_news: Callable[[RequestStream], None]) -> RequestStream:
        """The stream of ``request_id``'s outputs; ``on_news`` is called on the loop each time some arrive."""
        stream = self._streams[request_id] = RequestStream(request_id, on_news, self._token_bytes)
        return stream

    def close(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def submit(self, outputs: list[RequestOutput]) -> None:
        """Called by the step thread."""
        with self._lock:
            schedule = not self._pending
            self._pending += outputs
        if schedule:
            # The loop is gone only while the process shuts down; nobody is left to read then.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            outputs, self._pending = self._pending, []
        for output in outputs:
            if output.finish is not None and output.finish.error:
                self._on_error(output.finish.error)
            if (stream := self._streams.get(output.request_id)) is not None:
                stream.push(output)
