"""memory_store: the only code that speaks CQL. Chat history, runs and usage on Apache Cassandra.

The orchestrator uses ``MemoryStore`` (``memory_store.store``, a façade over one part per family of
tables) with the dataclasses of ``memory_store.models`` and the typed errors of ``memory_store.errors``;
``python -m memory_store schema`` applies the migrations. The local Cassandra node of development and
tests is the developer tools' (``localmesh.cassandra``). See docs/architecture/memory_store.md.
"""

from memory_store.config import StoreConfig
from memory_store.store import MemoryStore

__all__ = ["MemoryStore", "StoreConfig"]
