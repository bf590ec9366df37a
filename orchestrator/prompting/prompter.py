"""The prompt of a run: read the branch, fit it to the context window, refuse what cannot fit.

``continue_branch`` serves stored chats (the branch ending at a message, read by ``history`` after the
chat's summary, then the new turns); ``conversation`` serves Complete (a caller-supplied conversation,
nothing read). Both end in ``fit``: the answer's JSON schema, if any, is shown in the system turn
(prompting/schema_note.py), the window minus max_tokens is the budget, ``prompt.fit_prompt`` keeps the
newest turns that fit, and a prompt that cannot fit is INVALID_ARGUMENT naming the field at fault.
``completion`` serves a caller's prompt text, continued as it is.
"""

from __future__ import annotations

import time

from opentelemetry import trace

from chatmesh.errors import invalid
from chatmesh.limits import Generation
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, EncodedTexts
from memory_store.store import MemoryStore
from orchestrator.config import PromptConfig
from orchestrator.metrics import METRICS
from orchestrator.policy.refusals import refused
from orchestrator.prompting.history import History, load_history, turns
from orchestrator.prompting.prompt import Prompt, PromptTooLong, fit_prompt
from orchestrator.prompting.schema_note import with_schema_shown

tracer = trace.get_tracer("orchestrator")


class Prompter:
    def __init__(
        self,
        model: str,
        store: MemoryStore,
        tokenizer: ChatTokenizer,
        config: PromptConfig,
        context_window: int,
        recent: EncodedTexts | None,
    ) -> None:
        self.model = model  # the served model's name, which its metrics carry
        self.store = store
        self.tokenizer = tokenizer
        self.config = config
        self.context_window = context_window
        # The ids of recent prompts' texts, shared by the models of this tokenizer (its fingerprint).
        self.recent = recent

    async def history(self, user_id: str, chat_id: str, leaf_id: str | None) -> History:
        """The stored branch ending at ``leaf_id`` (None: the chat's newest message), after the chat's
        summary where it applies: what ``continue_branch`` continues."""
        return await load_history(self.store, user_id, chat_id, leaf_id, self.config.max_history_messages)

    def continue_branch(
        self,
        history: History,
        options: Generation,
        new: list[ChatMessage],
        field: str,
        system: list[ChatMessage] | None = None,
    ) -> Prompt:
        """The prompt continuing a stored ``history`` with the ``new`` turns (after ``system``, or the
        configured system prompt)."""
        summary_text = history.summary.text if history.summary else None
        return self.fit([*turns(history.messages), *new], options, summary_text, field, system=system)

    def conversation(
        self, system: list[ChatMessage], messages: list[ChatMessage], options: Generation
    ) -> Prompt:
        """A caller's whole conversation: it must fit as it is (nothing of it is dropped silently)."""
        prompt = self.fit(messages, options, None, "messages", system=system or None)
        if prompt.history == "truncated":
            raise refused(
                invalid(
                    "messages",
                    f"the conversation needs {prompt.full_tokens} tokens; {prompt.budget} fit in the "
                    f"{self.context_window}-token context window with max_tokens={options.max_tokens}",
                )
            )
        return prompt

    def completion(self, text: str, options: Generation) -> Prompt:
        """A completion prompt: ``text`` continued as it is (no template; BOS first where the model
        wants it), which must fit the window whole next to max_tokens."""
        ids = self.tokenizer.encode_prompt(text)
        budget = self.context_window - options.max_tokens
        if len(ids) > budget:
            raise refused(
                invalid(
                    "prompt",
                    f"the prompt needs {len(ids)} tokens; {max(budget, 0)} fit in the "
                    f"{self.context_window}-token context window with max_tokens={options.max_tokens}",
                )
            )
        return Prompt(ids, [], 1, 1, False, len(ids), budget, self.tokenizer.fingerprint)

    def fit(
        self,
        conversation: list[ChatMessage],
        options: Generation,
        summary: str | None,
        field: str,
        system: list[ChatMessage] | None = None,
    ) -> Prompt:
        budget = self.context_window - options.max_tokens
        if budget <= 0:
            raise refused(
                invalid(
                    "options.max_tokens",
                    f"max_tokens={options.max_tokens} leaves no room for a prompt in the "
                    f"{self.context_window}-token context window",
                )
            )
        started = time.monotonic()
        with tracer.start_as_current_span("assemble prompt") as span:
            try:
                prompt = fit_prompt(
                    self.tokenizer,
                    with_schema_shown(
                        system or [ChatMessage("system", self.config.system_prompt)],
                        conversation,
                        options.structured,
                    ),
                    conversation,
                    budget,
                    summary,
                    int(self.config.truncation_step * budget),
                    self.recent,
                )
            except PromptTooLong as exc:
                raise refused(
                    invalid(
                        field,
                        f"the prompt needs {exc.needed} tokens but {exc.budget} fit in the "
                        f"{self.context_window}-token context window with max_tokens={options.max_tokens}; "
                        "shorten the message or lower max_tokens",
                    )
                ) from None
            span.set_attribute("chatmesh.prompt.tokens", len(prompt.token_ids))
            span.set_attribute("chatmesh.prompt.budget", budget)
            span.set_attribute("chatmesh.prompt.turns_kept", prompt.turns_kept)
            span.set_attribute("chatmesh.prompt.turns_available", prompt.turns_available)
            span.set_attribute("chatmesh.prompt.history", prompt.history)
        METRICS.prompt_assembly.labels(self.model).observe(time.monotonic() - started)
        METRICS.prompt_history.labels(prompt.history, self.model).inc()
        return prompt
