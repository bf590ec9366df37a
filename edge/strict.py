"""The base of every request body the edge parses: an unknown field is refused (400 naming it), as
OpenAI's API refuses it, never silently ignored."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=False)
