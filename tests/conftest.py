"""Shared pytest setup. Fixtures that start real services live in tests/fixtures/, one module each."""

import os
import shutil
import tempfile
from pathlib import Path

from meshkit.telemetry import TRACE_FILE_ENV

pytest_plugins: list[str] = [
    "tests.fixtures.identity",
    "tests.fixtures.cassandra",
    "tests.fixtures.engines",
    "tests.fixtures.model",
    "tests.fixtures.router",
    "tests.fixtures.orchestrator",
    "tests.fixtures.envoy",
    "tests.fixtures.front_door",
    "tests.fixtures.browser",
]


def pytest_configure(config) -> None:
    # Every service the tests start inherits this, so a test can follow one trace across processes
    # (tests/orchestrator/test_tracing.py). A run that sets its own file keeps it.
    if TRACE_FILE_ENV not in os.environ:
        config.chatmesh_trace_dir = tempfile.mkdtemp(prefix="chatmesh-traces-")
        os.environ[TRACE_FILE_ENV] = str(Path(config.chatmesh_trace_dir) / "spans.jsonl")


def pytest_unconfigure(config) -> None:
    if trace_dir := getattr(config, "chatmesh_trace_dir", None):
        shutil.rmtree(trace_dir, ignore_errors=True)
