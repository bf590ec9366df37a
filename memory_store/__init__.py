"""memory_store: the only code that speaks CQL. Chat history, runs and usage on Apache Cassandra.

The orchestrator uses ``MemoryStore`` (``memory_store.store``) with the dataclasses of
``memory_store.models`` and the typed errors of ``memory_store.errors``; ``memory_store.node`` runs the
local Cassandra node (``python -m memory_store node ...``). See docs/architecture/memory_store.md.
"""

from memory_store.config import StoreConfig
from memory_store.store import MemoryStore

__all__ = ["MemoryStore", "StoreConfig"]
