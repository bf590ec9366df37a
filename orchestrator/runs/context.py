"""The replica's parts a run works with."""

from __future__ import annotations

from dataclasses import dataclass

from memory_store.store import MemoryStore
from orchestrator.config import OrchestratorConfig
from orchestrator.policy.moderation import Moderator
from orchestrator.prompting.models import Models
from orchestrator.runs.lifecycle import Runs
from orchestrator.upkeep.after_runs import Upkeep


@dataclass(frozen=True)
class RunContext:
    config: OrchestratorConfig
    store: MemoryStore
    runs: Runs
    models: Models
    moderator: Moderator
    upkeep: Upkeep
