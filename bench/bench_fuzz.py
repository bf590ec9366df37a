"""The long fuzz run: hostile requests at both doors of a whole mesh until a case count or a time limit.

Starts the mesh as processes on 127.0.0.1 (a Cassandra node, two null engines, a router, an orchestrator,
the edge and Envoy with ``make run``'s config) and sends random cases from tests/front_door/fuzzing.py
(the bounded, derandomized version runs in ``make test``: tests/front_door/test_mesh_fuzz.py): every HTTP
route of the edge and every ChatService method over gRPC, through Envoy. Each case is checked for the
doors' properties (no 5xx but capacity 503s, no INTERNAL/UNKNOWN, no leak, errors in the documented
shape, nothing stored by a refused request). Prints cases tried by route and status (HTTP) or method and
code (gRPC), the failures, and the rate; the run ends with the mesh answering a normal request.

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_fuzz.py [--cases 100000] [--minutes 5]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_front_door import start_door  # noqa: E402
from bench.bench_orchestrator import start_mesh, wait_for_engines  # noqa: E402
from bench.machine import machine  # noqa: E402
from localmesh.dev_jwt import generate_keys  # noqa: E402
from meshkit.launcher import Launcher  # noqa: E402
from tests.front_door.fuzzing import (  # noqa: E402
    GrpcCase,
    GrpcDoor,
    HttpCase,
    HttpDoor,
    Tally,
    check_grpc,
    check_http,
    grpc_cases,
    http_cases,
    own_ids,
)

BATCH = 500


def batch(http: HttpDoor, grpc_door: GrpcDoor, tally: Tally, examples: int) -> None:
    random_run = settings(
        max_examples=examples,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )

    @random_run
    @given(case=http_cases(http.ids))
    def one_http(case: HttpCase) -> None:
        tally.record(check_http(http, case), case)

    @random_run
    @given(case=grpc_cases(http.ids))
    def one_grpc(case: GrpcCase) -> None:
        tally.record(check_grpc(grpc_door, case), case)

    one_http()
    one_grpc()


def report(tally: Tally) -> None:
    elapsed = time.monotonic() - tally.started
    print(
        f"\n{tally.cases} cases in {elapsed:.0f} s ({tally.cases / elapsed:.1f}/s), "
        f"{tally.failed_cases} failed"
    )
    for label, count in sorted(tally.counts.items()):
        failed = f"  ({tally.failed[label]} failed)" if tally.failed[label] else ""
        print(f"  {count:7d}  {label}{failed}")
    for failure in tally.failures:
        print(f"FAIL {failure}")


def mesh_answers(http: HttpDoor) -> bool:
    reply = http.client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        headers=http.authorization("owner"),
    )
    return reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", type=int, default=100_000, help="stop after this many cases")
    parser.add_argument("--minutes", type=float, default=5.0, help="or after this long")
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--tokens-per-s", type=float, default=200.0, help="null engines' pace per stream")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    with (
        tempfile.TemporaryDirectory(prefix="bench-fuzz-") as tmp,
        Launcher(Path(tmp), echo=print) as launcher,
    ):
        print("starting Cassandra, engines, router, orchestrator, edge and Envoy ...", flush=True)
        keys = generate_keys(Path(tmp) / "dev-jwt")
        _, router, orchestrators = start_mesh(launcher, args, Path(tmp), keys)
        asyncio.run(wait_for_engines(router, args.engines))
        url = start_door(launcher, orchestrators, Path(tmp), keys)
        http = HttpDoor(url, keys.mint, own_ids(url, keys.mint))
        grpc_door = GrpcDoor(url.removeprefix("http://"), http)
        tally = Tally()
        deadline = tally.started + args.minutes * 60
        try:
            while tally.cases < args.cases and time.monotonic() < deadline:
                batch(http, grpc_door, tally, BATCH)
                print(f"  {tally.cases} cases, {tally.failed_cases} failed", flush=True)
        finally:
            report(tally)
        print(f"the mesh answers normally afterwards: {mesh_answers(http)}")


if __name__ == "__main__":
    main()
