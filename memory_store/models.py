"""What goes in and out of the memory store: plain dataclasses, never CQL rows.

Ids are strings (the canonical form of a time-based UUID), times are timezone-aware UTC datetimes,
and absent values are ``None`` (never stored as CQL nulls). The enums' values are what Cassandra
stores, so a row read in cqlsh is readable.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Generic, TypeVar

from chatmesh.finish import FinishReason, Usage
from chatmesh.tool_format import ToolCall
from memory_store.ids import id_time

T = TypeVar("T")


class Role(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    # A tool's result, for a call of the assistant message it follows (``Message.tool_call_id``).
    TOOL = "tool"


class MessageStatus(StrEnum):
    # The message is whole: a user message, or an answer that ended normally.
    COMPLETE = "complete"
    # An answer cut short (cancelled, failed, interrupted): the text is what was generated until then.
    INCOMPLETE = "incomplete"


class RunStatus(StrEnum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"
    INTERRUPTED = "interrupted"

    @property
    def terminal(self) -> bool:
        return self is not RunStatus.IN_PROGRESS


@dataclass(frozen=True)
class Chat:
    chat_id: str
    user_id: str
    title: str
    created_at: datetime
    # Latest activity (message, rename): the order of list_chats.
    updated_at: datetime
    # The chat's newest run while it is in progress; None otherwise.
    active_run_id: str | None = None
    # The model its answers come from when a send names none ("": the orchestrator's default).
    model: str = ""
    # The caller's key-value pairs (the OpenAI Conversations API's metadata).
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class SearchHit:
    """One match of a chat search: the chat's title (``message_id`` None) or one of its messages."""

    chat_id: str
    chat_title: str  # the chat's current title
    message_id: str | None  # None: the title matched
    role: str  # "title", "user" or "assistant"
    snippet: str  # the matched text around its first matching term
    created_at: datetime  # of the message (or of the chat, for a title)


@dataclass(frozen=True)
class Message:
    """One node of a chat's message tree. ``message_id`` is chosen by the writer (``ids.new_id``)."""

    message_id: str
    chat_id: str
    role: Role
    content: str
    # The message this one follows; None for a chat's first message. Always older than the message.
    parent_id: str | None = None
    token_count: int = 0
    model: str | None = None
    finish_reason: FinishReason | None = None
    status: MessageStatus = MessageStatus.COMPLETE
    # For a user message, the run that answers it (a retry's, where a run refused before answering was
    # replaced); for an assistant message, the run that wrote it.
    run_id: str | None = None
    usage: Usage | None = None
    # The fingerprint of the tokenizer ``token_count`` was counted with ("": unknown, as for messages
    # stored before it was recorded). A count is of one tokenizer: another one's reader counts anew.
    tokenizer_fingerprint: str = ""
    # An assistant message's tool calls (its content is the text beside them, often ""); a tool
    # message's call and the function it named.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    tool_name: str | None = None

    @property
    def created_at(self) -> datetime:
        """When the message was made: the time in its id."""
        return id_time(uuid.UUID(self.message_id))


@dataclass(frozen=True)
class Page(Generic[T]):
    """One page of a listing. ``next_cursor`` is None on the last page."""

    items: list[T]
    next_cursor: str | None


@dataclass(frozen=True)
class Versions:
    """A message among its versions: the messages of the same parent (edits, regenerations), oldest
    first. ``count`` 0: not known (a message stored before ``message_children``)."""

    count: int
    number: int  # from 1, the oldest
    previous_id: str | None
    next_id: str | None


UNKNOWN_VERSIONS = Versions(0, 0, None, None)


@dataclass(frozen=True)
class BranchPage(Page[Message]):
    """A page of a branch (``Page``), with each message's versions (``versions[i]``: ``items[i]``'s)."""

    versions: list[Versions]


@dataclass(frozen=True)
class Branch:
    """A path through the message tree, oldest first, ending at the requested message."""

    messages: list[Message]
    # The chat it belongs to, as read with it (so the caller's).
    chat: Chat
    # True when older ancestors exist that were not returned (max_messages reached).
    truncated: bool
    # The chat's rolling summary, when asked for with the branch (None: none, or not asked for).
    summary: ChatSummary | None = None


@dataclass(frozen=True)
class ChatSummary:
    """A rolling summary of a chat's older turns."""

    text: str
    token_count: int
    # The newest message the summary covers.
    through_message_id: str
    updated_at: datetime | None = None
    # The fingerprint of the tokenizer ``token_count`` was counted with ("": unknown).
    tokenizer_fingerprint: str = ""


@dataclass(frozen=True)
class Claim:
    """The ids an idempotency key reserves. The same key always yields the same ids, but for a run that
    ended without an answer, which a retry may replace with a new one (``renew_claim``)."""

    run_id: str
    user_message_id: str
    assistant_message_id: str
    # True for the call that created the claim; False when the key was already claimed.
    created: bool
    # False when the key was claimed by a request with a different fingerprint (refuse it).
    fingerprint_matches: bool
    # The start lease the creating call holds (``take_start_lease``); None when the key was claimed already.
    start_lease: datetime | None = None


@dataclass(frozen=True)
class RunDelta:
    """One event of a run's output stream: text, or a tool step (``step``)."""

    seq: int
    text: str
    token_count: int = 0
    # The output token ids the event covers (``token_count`` of them; empty where they were not kept):
    # a replica adopting the run resumes the generation from them.
    token_ids: tuple[int, ...] = ()
    # A tool step's record (orchestrator/runs/tool_steps.py, JSON) where the event is one; no text then.
    step: str = ""
    # The log-probabilities of its tokens where the run asked for them, as the orchestrator encodes them
    # (a chat.v1 Delta holding only its logprobs); empty otherwise. Replays and adopters give them again.
    logprobs: bytes = b""


@dataclass(frozen=True)
class Run:
    run_id: str
    user_id: str
    chat_id: str
    # The message the answer follows (the user message it answers).
    parent_message_id: str
    # Where the answer is stored when the run ends.
    assistant_message_id: str
    model: str
    # The orchestrator replica generating it.
    owner_id: str
    status: RunStatus
    created_at: datetime
    # The user message a send stored; None for regenerations.
    user_message_id: str | None = None
    finish_reason: FinishReason | None = None
    # Sequence number of the newest checkpointed event (of the final event once finished).
    last_seq: int = 0
    checkpointed_at: datetime | None = None
    finished_at: datetime | None = None
    usage: Usage | None = None
    error_code: str | None = None
    error_message: str | None = None
    # The prompt's tokens, stored at creation: what a run ended without its owner's count is charged
    # for its prompt (0 for runs created before it was stored).
    prompt_tokens: int = 0
    # How the answer is generated, opaque to the store (the orchestrator's serialized router request,
    # seed included): a replica that adopts the run continues it with this. Empty for older runs.
    generation: bytes = b""
    # The id its usage is charged under (usage.py), made as its budget was reserved: the window it is
    # charged in is the one it started in. Its run id for runs stored before charge ids.
    charge_id: str = ""
    # The fingerprint of the tokenizer its prompt and output are of: its answer's token count is one
    # of this tokenizer ("": unknown, as for runs stored before it was recorded).
    tokenizer_fingerprint: str = ""


@dataclass(frozen=True)
class NewRun:
    """A run to create (``create_run``, ``create_run_with_question``): the ids its send's claim
    reserved (``claim_idempotency_key``), the replica that runs it, and what it is charged and
    generated with."""

    user_id: str
    chat_id: str
    run_id: str
    # The message the answer follows (the user message it answers).
    parent_message_id: str
    assistant_message_id: str
    model: str
    # The orchestrator replica generating it.
    owner_id: str
    # The user message a send stores with it; None for regenerations.
    user_message_id: str | None = None
    # What it is charged for its prompt if it ends without its owner's count (``finish_run``).
    prompt_tokens: int = 0
    # How it is generated (opaque to the store), for a replica that adopts it.
    generation: bytes = b""
    # The id its budget was reserved under (``record_usage``), which every later charge of it uses;
    # empty: its run id.
    charge_id: str = ""
    # The fingerprint of the tokenizer of its prompt and output, which its answer's token count is
    # stored as one of ("": unknown).
    tokenizer_fingerprint: str = ""


@dataclass(frozen=True)
class RunOutcome:
    """How a run ended. ``tail`` holds the output events not yet checkpointed."""

    status: RunStatus
    last_seq: int
    finish_reason: FinishReason | None = None
    tail: tuple[RunDelta, ...] = ()
    usage: Usage | None = None
    error_code: str | None = None
    error_message: str | None = None


@dataclass(frozen=True)
class FinishedRun:
    run: Run
    # The stored assistant message; None when the run ended without output (e.g. failed at once).
    message: Message | None
    # False when the run had already ended (another finish, a cancel or an interruption won).
    applied: bool


@dataclass(frozen=True)
class UsageWindow:
    """A user's token usage in one budget window [start, end)."""

    user_id: str
    start: datetime
    end: datetime
    usage: Usage
    runs: int


@dataclass(frozen=True)
class StoreBounds:
    """Bounds of what only the store sees (the limits on requests are ``chatmesh.limits.Limits``);
    violations are INVALID_ARGUMENT."""

    max_assistant_content_bytes: int = 256 * 1024
    max_branch_messages: int = 1000
    max_summary_bytes: int = 64 * 1024
    max_checkpoint_deltas: int = 4096
    max_checkpoint_bytes: int = 256 * 1024
    max_generation_bytes: int = 1024 * 1024
    max_error_message_chars: int = 2000
    # How far in the future a writer-chosen id may be (clock skew between replicas).
    max_id_clock_skew_s: float = 300.0
    max_user_id_chars: int = 256
    # A tokenizer fingerprint: a model name and a hash (chatmesh.tokenizer).
    max_fingerprint_chars: int = 512
    # A chat's metadata (OpenAI's bounds).
    max_metadata_pairs: int = 16
    max_metadata_key_chars: int = 64
    max_metadata_value_chars: int = 512
