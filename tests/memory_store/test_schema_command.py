"""``python -m memory_store schema``: the deploy-time migration command and the check replicas wait on
(the Helm chart's schema Job and the orchestrator's init container), against the real node."""

import subprocess
import sys

from memory_store.schema import MIGRATIONS


def schema_command(node, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "memory_store", "schema", "--cql-port", str(node.node.config.cql_port), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_check_waits_for_migrations_that_the_job_then_applies(cassandra_node):
    keyspace = ["--keyspace", "chatmesh_schema_cmd"]
    missing = schema_command(cassandra_node, *keyspace, "--check")
    assert missing.returncode == 3, missing.stderr
    assert f"migrations {[m.version for m in MIGRATIONS]} pending" in missing.stdout

    applied = schema_command(
        cassandra_node, *keyspace, "--replication", "NetworkTopologyStrategy:datacenter1=1"
    )
    assert applied.returncode == 0, applied.stderr
    assert "applied migrations [1" in applied.stdout

    ready = schema_command(cassandra_node, *keyspace, "--check")
    assert ready.returncode == 0, ready.stderr
    assert "up to date" in ready.stdout
