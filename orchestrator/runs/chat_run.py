"""What the two kinds of run of a stored chat (send, regenerate) share: started once per idempotency
key, their run row and answer stored, their chat's summary kept fresh."""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

import grpc
from google.protobuf.message import Message as ProtoMessage
from opentelemetry import trace

from chatmesh.errors import ServiceError
from chatmesh.identity import Identity
from chatmesh.limits import Generation
from memory_store.errors import NotFound
from memory_store.models import Claim, Run
from orchestrator.prompting.prompt import Prompt
from orchestrator.runs.answer_run import AnswerRun
from orchestrator.runs.context import RunContext
from orchestrator.runs.live_run import RunInfo
from orchestrator.runs.relay import RunEnd

tracer = trace.get_tracer("orchestrator")


class ChatRun(AnswerRun):
    """A run of a stored chat: started once per idempotency key, its run row and answer stored."""

    outlives_caller = True

    def __init__(
        self, ctx: RunContext, identity: Identity, request: ProtoMessage, key: str, options: Generation
    ) -> None:
        super().__init__(identity)
        self.ctx = ctx
        self.options = options
        # A request without a key is its own run: only retries that carry a key can join.
        self._key = key or f"auto:{uuid.uuid4().hex}"
        self._fingerprint = _fingerprint(self.kind, request)

    @property
    def idempotency_key(self) -> str:
        return self._key

    async def claim(self) -> Claim | None:
        """Claims the idempotency key: the ids of this run. None when an earlier attempt with the key
        already started its run (here or on another replica): this one joins it and is live at once."""
        with tracer.start_as_current_span("claim idempotency key"):
            claim = await self.ctx.store.claim_idempotency_key(
                self.identity.user_id, self._key, self._fingerprint
            )
        if not claim.fingerprint_matches:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                "this idempotency key was already used for a different request; "
                "use a new key for a new message",
            )
        if not claim.created and await self._run_exists(claim.run_id):
            self.started.set_result(claim.run_id)
            return None
        return claim

    async def _run_exists(self, run_id: str) -> bool:
        """Whether an earlier attempt with this key started its run. An attempt on another replica may
        still be on its way to starting it, so look for a moment before concluding it never will."""
        runs = self.ctx.runs
        if runs.is_live(run_id):
            return True
        deadline = time.monotonic() + self.ctx.config.runs.claim_wait_s
        while True:
            try:
                await self.ctx.store.get_run(self.identity.user_id, run_id)
                return True
            except NotFound:
                pass
            if time.monotonic() > deadline or runs.is_live(run_id):
                return runs.is_live(run_id)
            await asyncio.sleep(0.1)

    def run_info(self, claim: Claim, chat_id: str, user_message_id: str = "") -> RunInfo:
        return RunInfo(
            run_id=claim.run_id,
            user_id=self.identity.user_id,
            tier=self.identity.tier,
            kind=self.kind,
            model=self.options.model,
            max_tokens=self.options.max_tokens,
            chat_id=chat_id,
            user_message_id=user_message_id,
            assistant_message_id=claim.assistant_message_id,
        )

    async def create_run(
        self, info: RunInfo, prompt: Prompt, parent_id: str, user_message_id: str | None
    ) -> Run:
        """The run's row, owned by this replica: from here on the answer is stored, once."""
        return await self.ctx.store.create_run(
            info.user_id,
            info.chat_id,
            run_id=info.run_id,
            parent_message_id=parent_id,
            assistant_message_id=info.assistant_message_id,
            model=info.model,
            owner_id=self.ctx.config.replica_id,
            user_message_id=user_message_id,
            prompt_tokens=len(prompt.token_ids),
        )

    def refresh_summary(self, chat_id: str, prompt: Prompt, end: RunEnd) -> None:
        """A history that outgrows its share of the prompt gets a new rolling summary (background)."""
        self.ctx.upkeep.refresh_summary(self.identity.user_id, chat_id, prompt, end.assistant_message_id)


def _fingerprint(kind: str, request: ProtoMessage) -> bytes:
    """What makes two requests "the same" for an idempotency key: everything but the key itself."""
    copy = type(request)()
    copy.CopyFrom(request)
    if hasattr(copy, "idempotency_key"):
        copy.idempotency_key = ""
    return hashlib.sha256(kind.encode() + b"\x00" + copy.SerializeToString(deterministic=True)).digest()
