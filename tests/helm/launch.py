"""What a rendered container would run: its argv after the image's entrypoint and any shell script, and the
launcher (torchrun, mpirun, trtllm-llmapi-launch) in front of the Python service, parsed into ranks.

Shell scripts are run for real by the shell the container names, with the launchers and ``python`` on
PATH replaced by shims that record their argv and exit, so loops, ``$@`` and host lists built from
LeaderWorkerSet's variables expand exactly as in the pod."""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

# The image's entrypoint (Dockerfile): these first arguments run `python -m <service>`.
ENTRYPOINT_SERVICES = ("engine", "router", "orchestrator", "edge", "memory_store")
SHIMMED = ("python", "python3", "mpirun", "torchrun", "trtllm-llmapi-launch")
SHELLS = ("sh", "bash")


@dataclass
class Launch:
    """``python -m <service> <args>``, started by ``launcher`` over ``ranks`` processes."""

    service: str
    args: list[str]
    launcher: str = ""  # "", "torchrun", "mpirun"
    ranks: int = 1
    mpi_program: list[str] = field(
        default_factory=list
    )  # what mpirun runs before python (trtllm-llmapi-launch)
    mpi_hosts: list[tuple[str, int]] = field(default_factory=list)  # (host, slots)
    mpi_mca: dict[str, str] = field(default_factory=dict)  # --mca name value


def container_argv(container: dict) -> list[str]:
    """The argv the container's process gets, through the image's entrypoint when no command is set."""
    if "command" in container:
        return [*container["command"], *container.get("args", [])]
    args = list(container.get("args", []))
    if args and args[0] in ENTRYPOINT_SERVICES:
        return ["python", "-m", *args]
    return args


def run_script(argv: list[str], env: dict[str, str], shim_dir: Path) -> list[list[str]]:
    """Runs ``sh -c SCRIPT ...`` with shims first on PATH; returns the argv of every shimmed call."""
    log = shim_dir / "calls.jsonl"
    log.unlink(missing_ok=True)
    for name in SHIMMED:
        shim = shim_dir / name
        shim.write_text(
            '#!/bin/sh\nexec "$SHIM_PYTHON" -c \'import json, os, sys; '
            'open(os.environ["SHIM_LOG"], "a").write(json.dumps(sys.argv[1:]) + "\\n")\' '
            f'{name} "$@"\n'
        )
        shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
    shell_env = {
        **env,
        "PATH": f"{shim_dir}:/usr/bin:/bin",
        "SHIM_LOG": str(log),
        "SHIM_PYTHON": sys.executable,
    }
    done = subprocess.run(argv, env=shell_env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, f"{argv[:2]} failed: {done.stderr}"
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def parse_launch(argv: list[str]) -> Launch | None:
    """The Python service ``argv`` starts and its launcher; None when it starts none of ours."""
    if not argv:
        return None
    name = os.path.basename(argv[0])
    if name == "torchrun":
        return _torchrun(argv[1:])
    if name == "mpirun":
        return _mpirun(argv[1:])
    if name in ("python", "python3") and len(argv) > 2 and argv[1] == "-m":
        return Launch(argv[2], argv[3:])
    return None


def _torchrun(argv: list[str]) -> Launch:
    parser = argparse.ArgumentParser(prog="torchrun", exit_on_error=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1)
    parser.add_argument("--nnodes", default="1")
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("-m", "--module", action="store_true")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    assert ns.module, "torchrun must run the engine as a module (--module engine)"
    assert ns.nnodes == "1" and ns.standalone, "one node: torchrun --standalone"
    return Launch(ns.script, ns.script_args, "torchrun", ns.nproc_per_node)


# mpirun options the chart may use: name -> how many values follow.
MPI_OPTIONS = {"-n": 1, "-np": 1, "--host": 1, "-H": 1, "-x": 1, "--mca": 2, "-mca": 2}
MPI_FLAGS = {"--oversubscribe", "--allow-run-as-root"}


def _mpirun(argv: list[str]) -> Launch:
    ranks, hosts, mca, i = 0, [], {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        option = argv[i]
        if option in MPI_FLAGS:
            i += 1
            continue
        assert option in MPI_OPTIONS, f"mpirun option {option} is not one this check knows"
        values = argv[i + 1 : i + 1 + MPI_OPTIONS[option]]
        if option in ("-n", "-np"):
            ranks = int(values[0])
        elif option in ("--host", "-H"):
            hosts = [(h.rsplit(":", 1)[0], int(h.rsplit(":", 1)[1])) for h in values[0].split(",")]
        elif option in ("--mca", "-mca"):
            mca[values[0]] = values[1]
        i += 1 + MPI_OPTIONS[option]
    program = argv[i:]
    prefix = []
    while program and os.path.basename(program[0]) not in ("python", "python3"):
        prefix.append(program.pop(0))
    inner = parse_launch(program)
    assert inner is not None, f"mpirun starts {argv[i:]}, not a chatmesh service"
    return Launch(inner.service, inner.args, "mpirun", ranks, prefix, hosts, mca)


def service_parsers() -> dict:
    """Each Python service's own parser: argv -> (namespace, its config, built and validated), or exit 2
    with the reason. memory_store has no config object (None)."""
    from edge.__main__ import parse_args as edge_args
    from engine.__main__ import parse_args as engine_args
    from memory_store.__main__ import parse_args as memory_store_args
    from orchestrator.config import parse as orchestrator_args
    from router.__main__ import parse_args as router_args

    return {
        "engine": engine_args,
        "router": router_args,
        "orchestrator": orchestrator_args,
        "edge": edge_args,
        "memory_store": lambda argv: (memory_store_args(argv), None),
    }
