"""How a generation ended and what it cost: the finish reason and token usage the engine reports, the
orchestrator relays and the memory store keeps (the enum's values are what Cassandra stores, and the
OpenAI API's ``finish_reason`` names)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FinishReason(StrEnum):
    STOP = "stop"  # end-of-sequence token, stop token id or stop string
    LENGTH = "length"  # max_tokens reached
    # Cancelled by the client (or, in the engine, the engine failed: then its Finish.error is set).
    CANCELLED = "cancelled"
    # The orchestrator's output moderation stopped the answer (never an engine's reason).
    CONTENT_FILTER = "content_filter"
    # The run failed or was interrupted (never an engine's reason: it says CANCELLED with an error).
    ERROR = "error"


@dataclass(frozen=True)
class Usage:
    """Token accounting of one generation, or of one answer (its turns added up)."""

    prompt_tokens: int = 0  # context at the start: prompt plus resumed output
    cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    completion_tokens: int = 0  # output tokens generated (in the engine: resumed ones not counted)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.cached_prompt_tokens + other.cached_prompt_tokens,
            self.completion_tokens + other.completion_tokens,
        )
