"""OpenAI's embeddings route, ``POST /v1/embeddings`` (-> ChatService.Embed): one unit vector per input
from an embedding model's pool, charged to the caller's token budget as prompt tokens.

``encoding_format`` "base64" returns each vector as OpenAI does: its float32 little-endian bytes in
base64. ``dimensions`` is taken only at the model's own length (all-MiniLM-L6-v2's 384): shortening and
renormalising is sound only for models trained for it (Matryoshka), which chatmesh serves none of.
"""

from __future__ import annotations

import base64
import re

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatmesh.chat.v1 import chat_pb2
from edge.bodies import read_json, validate_model
from edge.chats_api import caller_of
from edge.errors import ApiError
from edge.schemas import EmbeddingIn

# The orchestrator names an input `inputs[i]`; OpenAI's body calls them `input`.
_INPUTS_PARAM = re.compile(r"^inputs\b")


def embed_request(body: EmbeddingIn) -> chat_pb2.EmbedRequest:
    given = body.input
    # One string or one token array is one input; a list of strings or of token arrays (or []) is many.
    one = isinstance(given, str) or (bool(given) and isinstance(given[0], int))
    items: list = [given] if one else list(given)
    return chat_pb2.EmbedRequest(
        model=body.model,
        inputs=[
            chat_pb2.EmbedInput(text=item) if isinstance(item, str) else chat_pb2.EmbedInput(token_ids=item)
            for item in items
        ],
        dimensions=body.dimensions or 0,
    )


async def embeddings(request: Request) -> Response:
    orchestrator, settings = request.app.state.orchestrator, request.app.state.settings
    body = validate_model(EmbeddingIn, await read_json(request, settings.max_body_bytes))
    try:
        answer: chat_pb2.EmbedResponse = await orchestrator.unary(
            "Embed", embed_request(body), caller_of(request)
        )
    except ApiError as error:
        if error.param:
            error.param = _INPUTS_PARAM.sub("input", error.param)
        raise
    if body.encoding_format == "base64":
        vectors: list = [base64.b64encode(e.vector_f32).decode() for e in answer.embeddings]
    else:
        vectors = [np.frombuffer(e.vector_f32, dtype="<f4").tolist() for e in answer.embeddings]
    return JSONResponse(
        {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
            "model": answer.model,
            "usage": {"prompt_tokens": answer.prompt_tokens, "total_tokens": answer.prompt_tokens},
        }
    )


routes = [Route("/v1/embeddings", embeddings, methods=["POST"])]
