"""Embedding calls at the router: placed on the embedding pool of the model they name (the engines whose
GetModelInfo says MODEL_KIND_EMBEDDING), the least busy healthy engine first.

Embedding engines have no KV cache to route by: the one signal is how busy each is, the calls this
router has in flight there plus the calls its last load report said were waiting. A vector is a pure
function of its input, so a call an engine fails UNAVAILABLE (it died, or drains) is sent again, once,
to another engine of the pool. The engine's answer (or refusal) goes back as it is.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import grpc

from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import ServiceError, invalid, parse, unavailable
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_of_proto
from router.engines import EngineState

EMBED_ATTEMPTS = 2
DEFAULT_TIMEOUT_S = 30.0  # a call that came without a deadline


def embeds(engine: EngineState) -> bool:
    """Whether the engine serves an embedding model (as far as its last GetModelInfo said)."""
    return engine.info is not None and engine.info.kind == engine_pb2.MODEL_KIND_EMBEDDING


class EmbedCalls:
    def __init__(self, engines: Callable[[], list[EngineState]], rng: random.Random | None = None) -> None:
        """``engines()``: the engines the router knows (``EngineRegistry.engines``)."""
        self._engines = engines
        self._rng = rng or random.Random()
        self._inflight: Counter[str] = Counter()

    async def embed(
        self, request: router_pb2.EmbedRequest, timeout_s: float | None
    ) -> router_pb2.EmbedResponse:
        call = engine_pb2.EmbedRequest()
        call.CopyFrom(request.embed)
        call.priority = tier_of_proto(request.tier or router_pb2.TIER_FREE).priority
        call.model = self._model_of(call.model)
        tried: set[str] = set()
        while True:
            engine = self._pick(call.model, tried)
            tried.add(engine.engine_id)
            self._inflight[engine.engine_id] += 1
            try:
                answer = await engine.stub.Embed(call, timeout=timeout_s or DEFAULT_TIMEOUT_S)
                return router_pb2.EmbedResponse(embed=answer, engine_id=engine.engine_id)
            except grpc.aio.AioRpcError as exc:
                error = parse(exc)
                if error.code != grpc.StatusCode.UNAVAILABLE or len(tried) >= EMBED_ATTEMPTS:
                    raise error from None
            finally:
                self._inflight[engine.engine_id] -= 1
                if not self._inflight[engine.engine_id]:
                    del self._inflight[engine.engine_id]

    def _pool(self, model: str) -> list[EngineState]:
        return [e for e in self._engines() if embeds(e) and e.info is not None and e.info.model == model]

    def _model_of(self, model: str) -> str:
        """The model named, or the only embedding model served."""
        if model:
            return model
        served = sorted({e.info.model for e in self._engines() if embeds(e) and e.info is not None})
        if len(served) != 1:
            raise invalid("model", f"name an embedding model; served: {', '.join(served) or 'none'}")
        return served[0]

    def _pick(self, model: str, tried: set[str]) -> EngineState:
        pool = self._pool(model)
        if not pool:
            served = sorted({e.info.model for e in self._engines() if embeds(e) and e.info is not None})
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"no embedding engine serves model {model!r}; embedding models served: {', '.join(served) or 'none'}",
            )
        healthy = [e for e in pool if e.healthy and e.engine_id not in tried]
        if not healthy:
            raise unavailable(f"no healthy engine of the embedding model {model!r} right now")

        def busy(engine: EngineState) -> tuple[int, float]:
            waiting = engine.load.waiting_requests if engine.load is not None else 0
            return self._inflight[engine.engine_id] + waiting, self._rng.random()

        return min(healthy, key=busy)
