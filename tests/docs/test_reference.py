"""The generated reference pages match the code (flags from each service's --help, metrics from each
component's metrics class), and docs/api/errors.md's mapping is the edge's, status by status."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import grpc

from edge.errors import from_status

ROOT = Path(__file__).resolve().parents[2]


def test_flag_and_metric_references_are_generated_from_the_code() -> None:
    done = subprocess.run(
        [sys.executable, "scripts/gen_reference.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def documented_mapping() -> dict[str, tuple[int, str, str]]:
    """gRPC status name -> (HTTP status, error.type, error.code), from the mapping table."""
    text = (ROOT / "docs" / "api" / "errors.md").read_text()
    table = text.split("## The mapping", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        row = re.match(r"^\| `([A-Z_]+)` \| (\d{3}) \| `(\w+)` \| `(\w+)` \|", line)
        if row:
            rows[row.group(1)] = (int(row.group(2)), row.group(3), row.group(4))
    return rows


def test_the_error_mapping_page_is_the_edges_mapping_for_every_grpc_status() -> None:
    documented = documented_mapping()
    actual = {}
    for code in grpc.StatusCode:
        if code is grpc.StatusCode.OK:
            continue
        error = from_status(code, "a message")
        actual[code.name] = (error.status, error.type, error.code)
    assert documented == actual
