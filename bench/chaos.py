"""The chaos suite (``make chaos``): a steady chat load on the multi-replica local mesh while every kind of
component is killed (-9), terminated, paused (SIGSTOP, then SIGCONT) and slowed, N times each.

Starts ``make run``'s services on free ports under its supervisor (localmesh/chaos/topology.py): 2
orchestrators, 2 routers, 3 null engines paced at ``--tokens-per-s`` per stream, a 3-node Cassandra
cluster, the edge and Envoy. ``--users`` users chat through Envoy as the chat page does (send, read
SSE, resume with Last-Event-ID, back off on 429/503); ``--tool-share`` of their questions make the
orchestrators run their calculator (tool steps: localmesh/chaos/tool_load.py). Faults go one at a time,
each to the next replica of its component; the next waits until the mesh has recovered. Then every chat
is read back through the door and compared with what was streamed. Prints, per fault kind: injected,
answers completed, stream gaps, duplicate events, stored != streamed, lost messages, client-visible
errors, time to recover, and of the tool steps: stored, tools run, interrupted, run twice, step events a
stream missed; and writes the same as JSON. The goal: every answer completes, every other column 0
(but steps, ran and interrupted).

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/chaos.py [--repeat 1] [--users 8] \
        [--components engine router ...] [--actions kill term pause slow] [--tool-share 0.25] \
        [--json .run/chaos/result.json]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from localmesh.chaos.faults import ACTIONS, FaultTiming, faults_for  # noqa: E402
from localmesh.chaos.load import TIER, LoadSettings  # noqa: E402
from localmesh.chaos.report import markdown, table, write_json  # noqa: E402
from localmesh.chaos.suite import ChaosSettings, Suite  # noqa: E402
from localmesh.chaos.topology import COMPONENTS, ChaosMesh, Topology  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--components", nargs="+", choices=COMPONENTS, default=list(COMPONENTS))
    parser.add_argument("--actions", nargs="+", choices=ACTIONS, default=list(ACTIONS))
    parser.add_argument("--repeat", type=int, default=1, help="injections of each fault kind")
    parser.add_argument("--users", type=int, default=8, help="users chatting at once")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per answer")
    parser.add_argument("--tokens-per-s", type=float, default=25.0, help="null engines' pace per stream")
    parser.add_argument(
        "--tool-share",
        type=float,
        default=0.25,
        help="share of questions whose answers take tool steps (0: the orchestrators' tools off)",
    )
    parser.add_argument("--orchestrators", type=int, default=2)
    parser.add_argument("--routers", type=int, default=2)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--cassandra-nodes", type=int, default=3, help="1: one node (it has no replica)")
    parser.add_argument("--pause-s", type=float, default=3.0, help="how long a paused process stays stopped")
    parser.add_argument("--slow-ms", type=float, default=300.0, help="latency a slowed link adds per chunk")
    parser.add_argument("--slow-s", type=float, default=5.0, help="how long a link stays slow")
    parser.add_argument("--baseline-s", type=float, default=10.0, help="load alone before the first fault")
    parser.add_argument("--settle-s", type=float, default=3.0, help="load alone after each recovery")
    parser.add_argument("--json", type=Path, default=ROOT / ".run" / "chaos" / "result.json")
    parser.add_argument("--markdown", action="store_true", help="print the table for docs/ too")
    parser.add_argument(
        "--run-dir", type=Path, help="keep the services' data and logs here (default: a temp dir)"
    )
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    topology = Topology(
        orchestrators=args.orchestrators,
        routers=args.routers,
        engines=args.engines,
        cassandra_nodes=args.cassandra_nodes,
        tokens_per_s=args.tokens_per_s,
        delay_proxies="slow" in args.actions,
        tools=args.tool_share > 0,
    )
    settings = ChaosSettings(
        load=LoadSettings(users=args.users, max_tokens=args.max_tokens, tool_share=args.tool_share),
        timing=FaultTiming(pause_s=args.pause_s, slow_ms=args.slow_ms, slow_s=args.slow_s),
        repeat=args.repeat,
        baseline_s=args.baseline_s,
        settle_s=args.settle_s,
    )
    faults = faults_for(args.components, args.actions)
    workload = (
        f"{args.users} {TIER} users chatting through Envoy (stored chats, SSE, resume with Last-Event-ID), "
        f"{args.max_tokens} tokens per answer from null engines paced at {args.tokens_per_s:g} tokens/s per "
        f"stream, {settings.load.think_s:g} s between messages; {args.tool_share:.0%} of questions call "
        f"the calculator (--tool-max-steps {topology.tool_max_steps}, {settings.load.tool_max_tokens} "
        f"tokens per answer); {topology.orchestrators} orchestrators, "
        f"{topology.routers} routers, {topology.engines} engines, {topology.cassandra_nodes} Cassandra "
        f"node(s), edge, Envoy; {len(faults)} fault kinds x {args.repeat}; pause {args.pause_s:g} s, slow "
        f"+{args.slow_ms:g} ms per chunk for {args.slow_s:g} s"
    )
    print(f"machine: {machine()}\nworkload: {workload}", flush=True)
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        mesh = ChaosMesh(topology, args.run_dir or Path(tmp))
        try:
            print(f"starting the mesh ... up in {mesh.start():.0f}s; faults:", flush=True)
            result = Suite(mesh, settings).run(faults)
        finally:
            mesh.close()
    print(f"\n{result.answers} answers in {result.seconds:.0f}s\n{table(result.rows)}")
    if args.markdown:
        print(f"\n{markdown(result.rows)}")
    context = {"machine": machine(), "workload": workload, "seconds": round(result.seconds, 1)}
    write_json(args.json, context, result.rows, result.injections)
    print(f"\nmachine at the end: {machine()}\nJSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
