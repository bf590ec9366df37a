"""Embedding calls (ChatService.Embed, OpenAI's /v1/embeddings): checked, charged to the caller's token
budget like a generation, and sent to the router, which places them on the model's embedding pool.

The budget is reserved before the call at one token per input character (two more per input for
[CLS] and [SEP]; an id array at its length plus two), which no WordPiece text exceeds (each token
covers at least one character), and settled after it at the tokens the engine counted: a spent
budget refuses the call (RESOURCE_EXHAUSTED), a failed call costs nothing. Both records are the
call's one usage row (its charge id), so a settle that repeats changes nothing.

The hop to the router and on to the engine is a unary call, the one path embeddings take: one
message each way with nothing streamed between, where a link (meshkit/links.py) pays for many
events of long-lived requests (docs/embeddings.md).
"""

from __future__ import annotations

import asyncio

from chatmesh.chat.v1 import chat_pb2
from chatmesh.engine.v1 import engine_pb2
from chatmesh.errors import invalid
from chatmesh.finish import Usage
from chatmesh.identity import Identity
from chatmesh.router.v1 import router_pb2
from chatmesh.tiers import tier_named
from memory_store.ids import new_id
from memory_store.store import MemoryStore
from orchestrator.policy.admission import Budgets
from orchestrator.router_client import RouterClient

MAX_INPUTS = 2048  # as OpenAI takes
MAX_INPUT_CHARS = 100_000  # a text this long is far past any embedding model's limit: refused unread
MAX_MODEL_CHARS = 256
# Special tokens every input gets ([CLS] and [SEP]), for the reservation.
SPECIAL_TOKENS = 2


class Embeddings:
    def __init__(self, budgets: Budgets, store: MemoryStore, router: RouterClient) -> None:
        self._budgets = budgets
        self._store = store
        self._router = router

    async def embed(
        self, identity: Identity, request: chat_pb2.EmbedRequest, within_s: float
    ) -> chat_pb2.EmbedResponse:
        estimate = Usage(prompt_tokens=_checked_estimate(request))
        limit = self._budgets.limit(identity.tier, request.model)
        if limit and estimate.prompt_tokens > limit:
            raise invalid(
                "inputs",
                f"these inputs may use up to {estimate.prompt_tokens} tokens, more than the {limit} per window "
                "your budget allows; send fewer or shorter inputs",
            )
        charge_id = str(new_id())
        await self._budgets.reserve(identity, charge_id, estimate, request.model)
        call = router_pb2.EmbedRequest(
            embed=engine_pb2.EmbedRequest(
                model=request.model,
                inputs=[engine_pb2.EmbedInput(text=i.text, token_ids=i.token_ids) for i in request.inputs],
                dimensions=request.dimensions,
            ),
            tier=tier_named(identity.tier).proto,
        )
        try:
            answer = (await self._router.embed(call, within_s)).embed
        except BaseException:
            await asyncio.shield(self._budgets.release(identity.user_id, charge_id))
            raise
        tokens = sum(e.token_count for e in answer.embeddings)
        await asyncio.shield(
            self._store.record_usage(identity.user_id, charge_id, Usage(prompt_tokens=tokens))
        )
        return chat_pb2.EmbedResponse(
            model=answer.model,
            embeddings=[chat_pb2.Embedding(vector_f32=e.vector_f32) for e in answer.embeddings],
            prompt_tokens=tokens,
        )


def _checked_estimate(request: chat_pb2.EmbedRequest) -> int:
    """The tokens ``request`` may use at most; INVALID_ARGUMENT for what no engine would take."""
    if not request.model or len(request.model) > MAX_MODEL_CHARS:
        raise invalid("model", f"model must name an embedding model (1 to {MAX_MODEL_CHARS} characters)")
    if not 1 <= len(request.inputs) <= MAX_INPUTS:
        raise invalid("inputs", f"inputs must hold 1 to {MAX_INPUTS} inputs, got {len(request.inputs)}")
    tokens = 0
    for i, item in enumerate(request.inputs):
        if not item.text and not item.token_ids:
            raise invalid(f"inputs[{i}]", f"input {i} is empty")
        if item.text and item.token_ids:
            raise invalid(f"inputs[{i}]", f"input {i} has both text and token ids")
        if len(item.text) > MAX_INPUT_CHARS:
            raise invalid(f"inputs[{i}]", f"input {i} has more than {MAX_INPUT_CHARS} characters")
        tokens += len(item.text) + len(item.token_ids) + SPECIAL_TOKENS
    return tokens
