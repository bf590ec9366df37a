"""What a stored run leaves to do in the background: a title for a new chat, a fresher rolling summary.

Both are low-priority generations through the router (``jobs.py``), either may be switched off, and
neither is ever in a send's way: they are queued after the run's end is stored.
"""

from __future__ import annotations

from dataclasses import dataclass

from chatmesh.tokenizer import ChatTokenizer
from orchestrator.prompting.prompt import Prompt
from orchestrator.upkeep.jobs import BackgroundJobs
from orchestrator.upkeep.summaries import Summarizer, needs_refresh
from orchestrator.upkeep.titles import Titler


@dataclass(frozen=True)
class Upkeep:
    jobs: BackgroundJobs
    titler: Titler | None
    summarizer: Summarizer | None

    def name_chat(self, user_id: str, chat_id: str, question: str, answer: str) -> None:
        """Titles a chat after its first exchange (the job keeps a title already set)."""
        titler = self.titler
        if titler is not None:
            self.jobs.submit("title", chat_id, lambda: titler.name_chat(user_id, chat_id, question, answer))

    def refresh_summary(
        self, user_id: str, chat_id: str, prompt: Prompt, leaf_id: str, tokenizer: ChatTokenizer
    ) -> None:
        """Summarizes the branch ending at ``leaf_id`` when its history outgrew its share of ``prompt``
        (counted with ``tokenizer``, the answering model's)."""
        summarizer = self.summarizer
        if summarizer is None or not leaf_id or not needs_refresh(prompt, summarizer.config):
            return
        self.jobs.submit(
            "summary",
            chat_id,
            lambda: summarizer.refresh(user_id, chat_id, leaf_id, prompt.budget, tokenizer),
        )
