"""Rolling summaries: when a branch's verbatim history outgrows a share of the prompt budget, the engine
condenses its older turns (plus the previous summary) into a new summary, in the background.

The newest turns worth ``keep_fraction`` of the budget stay verbatim; everything before them is
summarized, and the summary records the newest message it covers. Prompts then read only the turns
after that message (``history.load_history``), so a long chat costs a bounded prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.limits import Generation
from chatmesh.tokenizer import ChatMessage, ChatTokenizer
from memory_store.models import ChatSummary, Message
from memory_store.store import MemoryStore
from orchestrator.config import SummaryConfig
from orchestrator.prompting.history import load_history
from orchestrator.prompting.prompt import Prompt
from orchestrator.router_client import RouterClient
from orchestrator.upkeep.jobs import generate_text

SUMMARY_SYSTEM = (
    "You maintain a running summary of a conversation between a user and an assistant. Keep names, "
    "facts, numbers, decisions and open questions; drop pleasantries. Write plain prose."
)
SUMMARY_REQUEST = (
    "{previous}Conversation to add:\n{transcript}\n\nWrite the updated summary in at most {words} words."
)
# Longest text of one turn a summary prompt quotes.
TURN_CHARS = 2000


def needs_refresh(prompt: Prompt, config: SummaryConfig) -> bool:
    """True when the history already had to be cut, or will have to be soon."""
    return prompt.history == "truncated" or prompt.full_tokens > config.trigger_fraction * prompt.budget


def token_count(message: Message, tokenizer: ChatTokenizer) -> int:
    """The message's tokens in ``tokenizer``: its stored count where that was taken with this tokenizer,
    else counted now (the chat was answered by a model of another tokenizer, or the count predates
    their fingerprints)."""
    if message.tokenizer_fingerprint == tokenizer.fingerprint:
        return message.token_count
    return len(tokenizer.encode(message.content))


def split_for_summary(
    messages: list[Message], tokenizer: ChatTokenizer, keep_tokens: int
) -> tuple[list[Message], list[Message]]:
    """(older, newest): the newest messages worth at most ``keep_tokens`` of ``tokenizer`` stay
    verbatim."""
    kept = 0
    cut = len(messages)
    while cut > 0:
        tokens = token_count(messages[cut - 1], tokenizer)
        if kept + tokens > keep_tokens:
            break
        kept += tokens
        cut -= 1
    return messages[:cut], messages[cut:]


@dataclass(frozen=True)
class Summarizer:
    store: MemoryStore
    router: RouterClient
    tokenizer: ChatTokenizer
    config: SummaryConfig
    generation: Generation
    # Tokens a summary prompt may take (the context window minus the summary's max_tokens).
    prompt_budget: int
    max_history_messages: int
    deadline_s: float

    async def refresh(
        self, user_id: str, chat_id: str, leaf_id: str, budget: int, answering: ChatTokenizer
    ) -> None:
        """Summarizes the branch ending at ``leaf_id`` up to its newest turns: those worth
        ``keep_fraction`` of ``budget``, the answering model's prompt budget, counted with its tokenizer
        (``answering``), stay verbatim. The summary is written, and counted, by the summary model."""
        history = await load_history(self.store, user_id, chat_id, leaf_id, self.max_history_messages)
        messages = [m for m in history.messages if m.content]
        older, _ = split_for_summary(messages, answering, int(self.config.keep_fraction * budget))
        if not older:
            return
        previous = history.summary.text if history.summary else ""
        prompt = self._prompt(previous, older)
        text = await generate_text(
            self.router, prompt, self.generation, self.tokenizer.fingerprint, self.deadline_s
        )
        text = text.strip()
        if not text:
            return
        count = len(self.tokenizer.encode(text))
        summary = ChatSummary(
            text, count, older[-1].message_id, tokenizer_fingerprint=self.tokenizer.fingerprint
        )
        await self.store.put_summary(user_id, chat_id, summary)

    def _prompt(self, previous: str, older: list[Message]) -> list[int]:
        """The summary request. If it would not fit, the oldest turns give way first (the previous
        summary covers what came before them), then the text of the one turn left."""
        words = max(20, self.config.max_tokens * 3 // 4)
        lines = [f"{m.role.value.capitalize()}: {m.content[:TURN_CHARS]}" for m in older]
        head = f"Summary so far:\n{previous}\n\n" if previous else ""
        while True:
            request = SUMMARY_REQUEST.format(previous=head, transcript="\n".join(lines), words=words)
            ids = self.tokenizer.encode_chat(
                [ChatMessage("system", SUMMARY_SYSTEM), ChatMessage("user", request)]
            )
            if len(ids) <= self.prompt_budget:
                return ids
            if len(lines) > 1:
                lines = lines[max(1, len(lines) // 4) :]
            elif len(lines[0]) > 100:
                lines[0] = lines[0][: len(lines[0]) // 2]
            else:
                raise ValueError(f"a summary prompt does not fit {self.prompt_budget} tokens")
