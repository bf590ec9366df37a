"""The tool-using share of the chaos load: questions whose answers call the orchestrator's calculator, so
that tool steps (docs/tools.md) run while components die.

No model chooses to call a tool here: the null engines' text is a calculator call followed by filler
as long as the result's turn (``NULL_TEXT``), and a null engine's token at a position is its cycle's
token there. A new chat's first question padded so that its prompt is a whole number of cycles
(``aligned_question``) gets an answer that begins with the call; the turn after the step has a prompt
one cycle longer (the call, the result), so it calls again, up to ``--tool-max-steps``, then answers in
text. The prompt is the one the orchestrator assembles: its default system prompt with the tier's tools
described after it, then the question.
"""

from __future__ import annotations

import functools
import re
from collections import Counter
from pathlib import Path

from chatmesh.model_files import bundled_model_path
from chatmesh.tiers import TIERS
from chatmesh.tokenizer import ChatMessage, ChatTokenizer, load_tokenizer
from chatmesh.tool_format import result_text
from orchestrator.config import DEFAULT_SYSTEM_PROMPT, ToolConfig
from orchestrator.tools.toolbox import Toolbox, builtin_tools

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
RESULT = "42"  # the calculator's answer to CALL
# An orchestrator's audit line of a tool's execution, written before it runs (orchestrator/runs/relay.py).
_RAN = re.compile(r": tool step (\S+) runs \S+$")


@functools.cache
def tokenizer() -> ChatTokenizer:
    """The tokenizer of the model the local mesh serves (the null engines' too)."""
    return load_tokenizer(str(bundled_model_path()))


@functools.cache
def null_text() -> str:
    """The null engines' text: the call, then filler as long as the turn that carries its result."""
    tok = tokenizer()
    result_turn = len(tok.user_turn_after_answer(result_text(RESULT)))
    text = CALL + " a" * result_turn
    if len(tok.encode(text)) != len(tok.encode(CALL)) + result_turn:
        raise ValueError("the filler's tokens merge with the call's: the turns after a step misalign")
    return text


@functools.cache
def _system(tier: str) -> ChatMessage:
    tools = Toolbox(ToolConfig(enabled=True), builtin_tools(None), TIERS).tools_for(tier, 0)  # type: ignore[arg-type]
    if tools is None:
        raise ValueError(f"the {tier} tier is offered no tools")
    return ChatMessage("system", f"{DEFAULT_SYSTEM_PROMPT}\n\n{tools.system_text()}")


def first_prompt(question: str, tier: str) -> list[int]:
    """The prompt of a new chat whose first message is ``question``, from a user of ``tier`` (the
    orchestrator's defaults, ``--tools`` on)."""
    return tokenizer().encode_chat([_system(tier), ChatMessage("user", question)])


def aligned_question(text: str, tier: str) -> str:
    """``text`` padded so that the answer to it as a new chat's first message begins with the call."""
    cycle = len(tokenizer().encode(null_text()))
    pad = 0
    for _ in range(4 * cycle):
        question = text + " a" * pad
        short = -len(first_prompt(question, tier)) % cycle
        if not short:
            return question
        pad += short  # each " a" is a token of its own
    raise ValueError("no padding aligns the prompt with the null engines' cycle")


def executions(logs: list[Path]) -> Counter[str]:
    """How many times each call's tool ran (call id -> executions), from the orchestrators' logs (a
    replica killed mid-step wrote its line before the tool ran: it counts)."""
    ran: Counter[str] = Counter()
    for path in logs:
        if path.exists():
            with path.open(errors="replace") as log:
                ran.update(match[1] for line in log if (match := _RAN.search(line.rstrip("\n"))))
    return ran
