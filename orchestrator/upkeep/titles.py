"""Chat titles: after a chat's first exchange, the engine names it (in the background, low priority)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from chatmesh.limits import Generation
from chatmesh.tokenizer import ChatMessage, ChatTokenizer
from memory_store.store import MemoryStore
from orchestrator.router_client import RouterClient
from orchestrator.upkeep.jobs import generate_text

TITLE_SYSTEM = "You write short, specific titles for conversations."
TITLE_REQUEST = (
    "Write a title of at most six words for the conversation below. Reply with the title only.\n\n"
    "User: {question}\nAssistant: {answer}"
)
# Text of each side the title model sees.
EXCERPT_CHARS = 1500
MAX_TITLE_CHARS = 80


def clean_title(text: str) -> str:
    """The first line of a model's answer as a title: no quotes, "Title:" prefix or end punctuation."""
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    line = re.sub(r"^(?:title\s*:\s*)", "", line, flags=re.IGNORECASE)
    line = re.sub(r"\s+", " ", line.strip(" \"'`*#")).rstrip(" .:;,")
    if len(line) > MAX_TITLE_CHARS:
        line = line[:MAX_TITLE_CHARS].rsplit(" ", 1)[0]
    return line


def fallback_title(question: str) -> str:
    """The question's first words, when the model gave nothing usable."""
    return clean_title(" ".join(question.split()[:8])) or "New chat"


@dataclass(frozen=True)
class Titler:
    store: MemoryStore
    router: RouterClient
    tokenizer: ChatTokenizer
    generation: Generation
    deadline_s: float

    async def name_chat(self, user_id: str, chat_id: str, question: str, answer: str) -> None:
        """Gives an untitled chat a title made from its first exchange (a user's own title wins)."""
        if (await self.store.get_chat(user_id, chat_id)).title:
            return
        request = TITLE_REQUEST.format(question=question[:EXCERPT_CHARS], answer=answer[:EXCERPT_CHARS])
        prompt = self.tokenizer.encode_chat(
            [ChatMessage("system", TITLE_SYSTEM), ChatMessage("user", request)]
        )
        text = await generate_text(
            self.router, prompt, self.generation, self.tokenizer.fingerprint, self.deadline_s
        )
        title = clean_title(text) or fallback_title(question)
        # The user may have named the chat while the title was generated.
        if not (await self.store.get_chat(user_id, chat_id)).title:
            await self.store.rename_chat(user_id, chat_id, title)
