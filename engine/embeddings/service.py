"""EmbeddingService: an embedding engine's gRPC face (engine.v1 EngineService with MODEL_KIND_EMBEDDING).

It answers ``Embed`` (each call's inputs checked, tokenized off the loop, then batched with every other
call's by ``EmbeddingBatcher``), and what a router's supervisor reads of any engine: ``GetModelInfo``
(its kind and dimensions, so the router puts it in an embedding pool), ``WatchLoad``/``GetLoad`` (calls
waiting, serving), and ``KvEvents`` (an empty cache: one snapshot, then nothing until a drain). Every
``GenerateMany`` request is refused FAILED_PRECONDITION: this engine does not generate.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from chatmesh.engine.v1 import engine_pb2, engine_pb2_grpc
from chatmesh.errors import ServiceError, abort, invalid, unavailable
from engine.config import EngineConfig
from engine.embeddings.batcher import EmbeddingBatcher
from engine.embeddings.tokenizer import EmbeddingTokenizer
from engine.service import ENGINE_MESSAGES, watch_load
from meshkit.links import ServedRequests

log = logging.getLogger(__name__)

MAX_INPUTS = 2048  # per call, as OpenAI's /v1/embeddings takes


class EmbeddingService(engine_pb2_grpc.EngineServiceServicer):
    """Serves one embedding model. Create it on the event loop that serves it, then ``start()``."""

    def __init__(
        self,
        config: EngineConfig,
        model_dir: Path,
        tokenizer: EmbeddingTokenizer,
        batcher: EmbeddingBatcher,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.batcher = batcher
        encoder = batcher.encoder
        self.model = config.served_model_name or encoder.config.name
        self.dimensions = encoder.config.hidden_size
        self.instance_id = secrets.token_hex(8)
        self.fingerprint = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()[:16]
        self.backend = "cpu"
        self.draining = False
        self._watchers: set[asyncio.Event] = set()

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()

    async def drain(self) -> None:
        self.draining = True
        for wake in self._watchers:
            wake.set()

    @property
    def failure(self) -> str:
        return self.batcher.failure

    @property
    def serving(self) -> bool:
        return not (self.draining or self.failure)

    # -- Embed ---------------------------------------------------------------------------------------

    async def Embed(
        self, request: engine_pb2.EmbedRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EmbedResponse:
        try:
            return await self.embed(request)
        except ServiceError as exc:
            await abort(context, exc)
            raise  # abort raises; this line only tells the type checker

    async def embed(self, request: engine_pb2.EmbedRequest) -> engine_pb2.EmbedResponse:
        if not self.serving:
            raise unavailable(self.failure or "the engine is draining")
        if request.model and request.model != self.model:
            raise ServiceError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"this engine serves {self.model!r}, not {request.model!r}",
            )
        if request.dimensions and request.dimensions != self.dimensions:
            raise invalid(
                "dimensions",
                f"{self.model} computes {self.dimensions}-dimensional vectors and was not trained to have them "
                f"shortened; omit dimensions or pass {self.dimensions}",
            )
        inputs = await self._token_ids(request.inputs)
        vectors = await self.batcher.submit(inputs, request.priority or engine_pb2.PRIORITY_NORMAL)
        return engine_pb2.EmbedResponse(
            model=self.model,
            embeddings=[
                engine_pb2.Embedding(vector_f32=vector.astype("<f4").tobytes(), token_count=len(ids))
                for vector, ids in zip(vectors, inputs, strict=True)
            ],
        )

    async def _token_ids(self, inputs) -> list[list[int]]:
        """Each input's model ids ([CLS] … [SEP]); INVALID_ARGUMENT naming the first input refused."""
        if not 1 <= len(inputs) <= MAX_INPUTS:
            raise invalid("inputs", f"inputs must hold 1 to {MAX_INPUTS} inputs, got {len(inputs)}")
        texts = {}
        for i, item in enumerate(inputs):
            if bool(item.text) == bool(item.token_ids):
                raise invalid(
                    f"inputs[{i}]",
                    f"input {i} is empty" if not item.text else f"input {i} has text and token ids",
                )
            if item.text:
                texts[i] = item.text
        encoded = dict(
            zip(
                texts, await asyncio.to_thread(self.tokenizer.encode_texts, list(texts.values())), strict=True
            )
        )
        ids = [
            encoded[i] if i in encoded else self.tokenizer.wrap(item.token_ids)
            for i, item in enumerate(inputs)
        ]
        for i, input_ids in enumerate(ids):
            try:
                self.tokenizer.check(i, input_ids)
            except ValueError as exc:  # too long, or an id outside the vocabulary
                raise invalid(f"inputs[{i}]", str(exc)) from None
        return ids

    # -- what a router reads of every engine ----------------------------------------------------------

    async def GenerateMany(self, request_iterator, context: grpc.aio.ServicerContext):
        async for message in _Refused(self).serve(request_iterator, self._watchers):
            yield message

    async def KvEvents(
        self, request: engine_pb2.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.KvEventsResponse]:
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the engine is draining")
        yield engine_pb2.KvEventsResponse(
            engine_instance_id=self.instance_id, snapshot=engine_pb2.KvSnapshot()
        )
        wake = asyncio.Event()
        self._watchers.add(wake)
        try:
            await wake.wait()  # no cache, so no events: open until the drain ends it
        finally:
            self._watchers.discard(wake)

    async def WatchLoad(
        self, request: engine_pb2.WatchLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.WatchLoadResponse]:
        async for response in watch_load(request, context, self._watchers, lambda: self.draining, self._load):
            yield response

    async def GetLoad(
        self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetLoadResponse:
        return engine_pb2.GetLoadResponse(load=self._load())

    async def GetModelInfo(
        self, request: engine_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.GetModelInfoResponse:
        return engine_pb2.GetModelInfoResponse(
            model=self.model,
            tokenizer_fingerprint=self.fingerprint,
            context_length=self.tokenizer.max_tokens,
            vocab_size=self.tokenizer.vocab_size,
            backend=self.backend,
            tensor_parallel_size=1,
            engine_instance_id=self.instance_id,
            kind=engine_pb2.MODEL_KIND_EMBEDDING,
            embedding_dimensions=self.dimensions,
        )

    def _load(self) -> engine_pb2.EngineLoad:
        return engine_pb2.EngineLoad(
            waiting_requests=self.batcher.stats.waiting_calls,
            max_waiting_requests=self.config.max_waiting_requests,
            serving=self.serving,
        )


class _Refused(ServedRequests):
    """GenerateMany on an embedding engine: every request refused, naming why."""

    def __init__(self, service: EmbeddingService) -> None:
        super().__init__(ENGINE_MESSAGES, lambda: service.draining)
        self._model = service.model

    def start(self, request_id: str, frame: engine_pb2.RequestFrame) -> None:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"this engine serves the embedding model {self._model!r}: it computes embeddings (Embed), "
            "it does not generate",
        )

    def cancel(self, request_id: str) -> None:
        pass  # nothing runs here

    def stop(self, request_id: str) -> None:
        pass
