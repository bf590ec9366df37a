"""A Cassandra node of a benchmark's own: ``make run``'s configuration, free ports, a temporary directory."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from localmesh.cassandra.node import CassandraNode, NodeConfig, StartReport
from meshkit.launcher import Launcher, free_port


@contextlib.contextmanager
def private_node(prefix: str) -> Iterator[tuple[NodeConfig, StartReport]]:
    """Starts a single node (returns once CQL answers), and drains and stops it on the way out."""
    with (
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
        Launcher(Path(tmp) / "run", echo=lambda _: None) as launcher,
    ):
        config = NodeConfig(
            data_dir=Path(tmp) / "data", cql_port=free_port(), storage_port=free_port(), jmx_port=free_port()
        )
        node = CassandraNode(config, launcher)
        report = node.start()
        try:
            yield config, report
        finally:
            node.stop()
