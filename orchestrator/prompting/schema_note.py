"""What the model is told of the JSON schema its answer is constrained to.

The engine's grammar keeps a constrained answer valid, but only a model that sees the schema knows what
belongs in it: a small model shown nothing fills the fields with whatever comes (and loops inside its
strings). So, as OpenAI's models see a response format and as chatmesh's tools are described
(edge/tools.py), a prompt whose answer must follow a JSON schema gets it at the end of its system turn,
unless a message of the caller's already shows it (as the schema's text, as sent or compact).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from chatmesh.engine.v1 import engine_pb2
from chatmesh.tokenizer import ChatMessage

SCHEMA_NOTE = "Answer with JSON that follows this schema: "


def with_schema_shown(
    system: list[ChatMessage],
    conversation: Sequence[ChatMessage],
    structured: engine_pb2.StructuredOutput | None,
) -> list[ChatMessage]:
    """``system`` with the answer's JSON schema at the end of its last message (a new system message if
    there is none), if the answer has one that no message shows yet."""
    if structured is None or structured.WhichOneof("kind") != "json_schema":
        return system
    schema = structured.json_schema
    try:
        compact = json.dumps(json.loads(schema))
    except ValueError:
        return system  # the engine refuses it, naming the problem
    if any(schema in m.content or compact in m.content for m in [*system, *conversation]):
        return system
    note = SCHEMA_NOTE + compact
    if not system:
        return [ChatMessage("system", note)]
    last = system[-1]
    return [*system[:-1], ChatMessage(last.role, f"{last.content}\n\n{note}" if last.content else note)]
