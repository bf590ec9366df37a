"""The protos are lint-clean, backward compatible with the baseline, and the generated code is current."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_buf_lint_is_clean():
    result = run(str(BIN / "buf"), "lint")
    assert result.returncode == 0, result.stdout + result.stderr


def test_no_breaking_change_against_the_baseline():
    result = run(str(BIN / "buf"), "breaking", "--against", "protos/baseline.binpb")
    assert result.returncode == 0, result.stdout + result.stderr


def test_generated_code_matches_the_protos():
    result = run("bash", "scripts/gen_protos.sh", "--check")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize(
    "module",
    [
        "chatmesh",
        "engine",
        "router",
        "orchestrator",
        "memory_store",
        "edge",
        "chatmesh.chat.v1.chat_pb2_grpc",
        "chatmesh.router.v1.router_pb2_grpc",
        "chatmesh.engine.v1.engine_pb2_grpc",
    ],
)
def test_every_package_imports(module):
    importlib.import_module(module)
