"""A run's tool steps (docs/tools.md): how a step is an event of the run's stream and a record in its
checkpoints, and how each model turn after a step continues the same run.

A turn after a step is a new generation whose prompt is the run's first prompt, then every earlier
turn's output tokens, each followed by its step's result as a user turn (``user_turn_after_answer``),
and whose output so far is the current turn's tokens. Everything in it comes from the run's events,
so the replica that adopts a run rebuilds the same request from its checkpoints (``ToolLoop.replay``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from chatmesh.chat.v1 import chat_pb2
from chatmesh.finish import Usage
from chatmesh.router.v1 import router_pb2
from chatmesh.tokenizer import ChatTokenizer
from chatmesh.tool_format import ToolCall, parse_answer, result_text
from memory_store.models import RunDelta
from orchestrator.tools.toolbox import StepResult, Toolbox, offers_tools

OUTCOMES = {
    "ok": chat_pb2.TOOL_OUTCOME_OK,
    "error": chat_pb2.TOOL_OUTCOME_ERROR,
    "timeout": chat_pb2.TOOL_OUTCOME_TIMEOUT,
    "refused": chat_pb2.TOOL_OUTCOME_REFUSED,
    "interrupted": chat_pb2.TOOL_OUTCOME_INTERRUPTED,
}


def started_record(call: ToolCall, by: str) -> str:
    """The record of a step started by replica ``by``: two replicas that both think they own a run (one
    taken for dead, and its adopter) store different records for the same call, and only the one whose
    record is stored runs the tool (memory_store's ``store_step``)."""
    started = {"call_id": call.id, "tool": call.name, "arguments": call.arguments}
    return json.dumps({"started": started, "by": by})


def result_record(result: StepResult) -> str:
    return json.dumps(
        {
            "result": {
                "call_id": result.call_id,
                "tool": result.tool,
                "outcome": result.outcome,
                "text": result.text,
            }
        }
    )


def step_event(record: str) -> dict:
    """A step record as a RunEvent's kind (``RunEvent(seq=..., **step_event(record))``)."""
    step = json.loads(record)
    if "started" in step:
        return {"step_started": chat_pb2.ToolStepStarted(**step["started"])}
    result = step["result"]
    return {
        "step_result": chat_pb2.ToolStepResult(
            call_id=result["call_id"],
            tool=result["tool"],
            outcome=OUTCOMES[result["outcome"]],
            text=result["text"],
        )
    }


def call_of(record: str) -> ToolCall | None:
    step = json.loads(record)
    if "started" not in step:
        return None
    started = step["started"]
    return ToolCall(started["call_id"], started["tool"], started["arguments"])


def result_of(record: str) -> StepResult | None:
    step = json.loads(record)
    if "result" not in step:
        return None
    return StepResult(**step["result"])


@dataclass
class ToolLoop:
    """One run's use of the orchestrator's tools: whether its turn may call one, and the next turn."""

    toolbox: Toolbox
    tokenizer: ChatTokenizer
    # The run's first turn as placed (its stored generation).
    first: router_pb2.GenerateStart
    user_id: str
    tier: str
    steps: int = 0
    # The ids after the first prompt: earlier turns' output and their results, as the model reads them.
    _carried: list[int] = field(default_factory=list)
    # What the turns before the current one used (charged with the run's usage).
    earlier: Usage = field(default_factory=Usage)

    @classmethod
    def of(
        cls,
        toolbox: Toolbox | None,
        tokenizer: ChatTokenizer,
        first: router_pb2.GenerateStart,
        user_id: str,
        tier: str,
    ) -> ToolLoop | None:
        """The loop of a run whose first turn was offered ``toolbox``'s tools (None if it was not).
        Which tools it was offered is in its grammar, whatever the MCP servers list now: a run goes on
        with the tools it started with (a call to one no longer there is answered so)."""
        if toolbox is None or not offers_tools(first.sampling.structured.grammar):
            return None
        return cls(toolbox, tokenizer, first, user_id, tier)

    def offered(self) -> bool:
        """Whether the current turn was offered the tools (its grammar is the first turn's)."""
        return self.steps < self.toolbox.config.max_steps

    def call_in(self, turn_text: str, finished_by_stop: bool) -> ToolCall | None:
        """The tool call a turn that was offered tools ended with, if any (one per turn)."""
        if not finished_by_stop or not self.offered():
            return None
        _, calls = parse_answer(turn_text, f"{self.first.request_id.partition('~')[0]}:{self.steps}")
        return calls[0] if calls else None

    async def run(self, call: ToolCall) -> StepResult:
        return await self.toolbox.run(self.user_id, self.tier, call)

    def reservation(self, turn: router_pb2.GenerateStart) -> Usage:
        """What the run may use in all while ``turn`` is its current turn: the turns before it, its
        prompt and the tokens left to it (for the first turn, what its send reserved). Each step adds
        the next turn's prompt to it (docs/tools.md, "Budget")."""
        return self.earlier + Usage(len(turn.prompt_token_ids), 0, turn.sampling.max_tokens)

    def next_turn(
        self, turn_ids: Sequence[int], turn_usage: Usage, result: StepResult, completion_so_far: int
    ) -> router_pb2.GenerateStart | None:
        """The request of the turn after a step (None when the run has no tokens left for one: the
        turn is then the run's last, and counted as such)."""
        left = self.first.sampling.max_tokens - completion_so_far
        if left < 1:
            return None
        self.steps += 1
        self.earlier = self.earlier + turn_usage
        ids = list(turn_ids)
        while ids and ids[-1] in self.tokenizer.eos_token_ids:  # the template's own end follows
            ids.pop()
        self._carried += ids
        self._carried += self.tokenizer.user_turn_after_answer(result_text(result.text))
        frame = router_pb2.GenerateStart()
        frame.CopyFrom(self.first)
        frame.request_id = f"{self.first.request_id.partition('~')[0]}~step{self.steps}"
        frame.prompt_token_ids.extend(self._carried)
        frame.sampling.max_tokens = left
        if not self.offered():
            frame.sampling.ClearField("structured")  # the last turn answers in text
        return frame

    def replay(
        self, output: Sequence[RunDelta]
    ) -> tuple[router_pb2.GenerateStart, list[int], ToolCall | None]:
        """From an adopted run's events: the current turn's request, its output so far, and a step
        found started without its result (whose result the adopter stores: ``Toolbox.interrupted``)."""
        frame, turn_ids, completion = self.first, list[int](), 0
        pending: ToolCall | None = None
        for event in output:
            if not event.step:
                turn_ids += event.token_ids
                completion += event.token_count
                continue
            if (call := call_of(event.step)) is not None:
                turn_ids += event.token_ids  # the call's own tokens
                completion += event.token_count
                pending = call
                continue
            result = result_of(event.step)
            assert result is not None
            prompt = len(frame.prompt_token_ids)
            next_frame = self.next_turn(turn_ids, Usage(prompt, 0, len(turn_ids)), result, completion)
            if next_frame is None:
                raise ValueError("its answer has no tokens left after its last tool step")
            frame, turn_ids, pending = next_frame, [], None
        return frame, turn_ids, pending
