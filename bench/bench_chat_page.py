"""The chat page in Chromium, two cases (docs/benchmarks/chat_page.md).

``render``: the main thread's longest task while a Markdown answer streams into edge/static/render.js
(StreamingAnswer, at most one render per animation frame), and the cost of showing a whole stored answer
(a big table fills in a chunk of rows per task), for an ordinary answer and for a huge table. The page's
own files are served with the edge's security headers (edge.pages: so under its CSP) by a small stdlib
HTTP server; tokens are fed in the page by a timer at a set pace, so the numbers are the renderer's, not
the network's.

``long-chat``: the whole page through Envoy, the edge and an orchestrator over Cassandra (null engine),
on a chat of ``--chat-messages`` messages and one of ``--small-chat`` (seeded straight into Cassandra
with MemoryStore, an exchange a second, answers of ordinary Markdown): the time from navigation until
the chat's last message is on screen (``--opens`` warm opens after one cold), the longest main-thread
task while a script scrolls to the top (``--scroll-px`` a frame, older pages loading as it goes),
the message elements in the page, and the tab's JS heap (after a garbage collection) for each chat.

Run it under the machine-wide lock:

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_chat_page.py --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import http.server
import json
import os
import statistics
import sys
import tempfile
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from chatmesh.finish import FinishReason, Usage

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_front_door import start_door
from bench.bench_orchestrator import start_mesh
from bench.machine import machine
from edge.pages import SECURITY_HEADERS, STATIC_DIR
from localmesh.dev_jwt import generate_keys
from memory_store.config import StoreConfig
from memory_store.ids import new_id
from memory_store.models import Message, Role
from memory_store.store import MemoryStore
from meshkit.launcher import Launcher, free_port
from tests.fixtures.browser import CHROMIUM_FLAGS, chromium_path

# An ordinary answer: prose, a list, a code block and a small table, repeated to the token count.
SECTION = (
    "Here is how it works, step by step, with *emphasis* and `inline code`.\n\n"
    "1. Parse the request\n2. Route it to an engine\n3. Stream the tokens back\n\n"
    "```python\ndef answer(question):\n    tokens = engine.generate(question)\n    return ''.join(tokens)\n```\n\n"
    "| stage | p50 ms | p99 ms |\n|---|---:|---:|\n| router | 0.4 | 1.2 |\n| engine | 31 | 48 |\n\n"
)

STREAM = """async ([tokens, intervalMs]) => {
    const { StreamingAnswer } = await import("/static/render.js");
    const host = document.createElement("div");
    document.body.append(host);
    let longest = 0, frames = 0;
    const observer = new PerformanceObserver((list) => {
        for (const entry of list.getEntries()) longest = Math.max(longest, entry.duration);
    });
    observer.observe({ type: "longtask" });
    const view = new StreamingAnswer(host, () => frames++);
    let text = "";
    const started = performance.now();
    for (const token of tokens) {
        text += token;
        view.update(text);
        await new Promise((resolve) => setTimeout(resolve, intervalMs));
    }
    await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve, 0)));
    const finishStart = performance.now();
    view.finish();
    const finishMs = performance.now() - finishStart;
    await new Promise((resolve) => setTimeout(resolve, 100));
    observer.disconnect();
    host.remove();
    return { longestTaskMs: longest, frames, streamMs: finishStart - started, finishMs };
}"""

WHOLE = """async (text) => {
    const { renderMarkdown } = await import("/static/render.js");
    const host = document.createElement("div");
    document.body.append(host);
    let longest = 0;
    const observer = new PerformanceObserver((list) => {
        for (const entry of list.getEntries()) longest = Math.max(longest, entry.duration);
    });
    observer.observe({ type: "longtask" });
    const started = performance.now();
    const { fragment, complete } = renderMarkdown(text);
    host.append(fragment);
    host.getBoundingClientRect();
    const firstMs = performance.now() - started;
    await complete;
    host.getBoundingClientRect();
    const wholeMs = performance.now() - started;
    await new Promise((resolve) => setTimeout(resolve, 100));
    observer.disconnect();
    host.remove();
    return { firstMs, wholeMs, longest };
}"""


def ordinary_tokens(count: int) -> list[str]:
    text = SECTION * (count // 40 + 1)
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    return pieces[:count]


def table_tokens(rows: int) -> list[str]:
    header = ["| id | name | value | note |\n", "|---|---|---|---|\n"]
    return header + [f"| {i} | row {i} | {i * 7} | note |\n" for i in range(rows)] + ["\nThe end."]


class PageFiles(http.server.SimpleHTTPRequestHandler):
    """edge/ as the document root, so /static/... are the page's files, with the edge's headers."""

    def end_headers(self) -> None:
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        super().end_headers()

    def log_message(self, *args: object) -> None:
        pass


def serve() -> str:
    handler = functools.partial(PageFiles, directory=str(STATIC_DIR.parent))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def render_cases(args: argparse.Namespace, playwright) -> None:
    url = serve()
    cases = {
        f"stream {args.tokens} Markdown tokens": ordinary_tokens(args.tokens),
        f"stream a {args.table_rows}-row table": table_tokens(args.table_rows),
    }
    browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
    page = browser.new_page()
    page.goto(f"{url}/static/vendor/manifest.json")  # an origin to import the modules from
    for name, tokens in cases.items():
        runs = [page.evaluate(STREAM, [tokens, args.interval_ms]) for _ in range(args.repeats)]
        whole = [page.evaluate(WHOLE, "".join(tokens)) for _ in range(args.repeats)]
        longest = [run["longestTaskMs"] for run in runs]
        print(
            json.dumps(
                {
                    "case": name,
                    "repeats": args.repeats,
                    "longest_task_ms": {"median": statistics.median(longest), "max": max(longest)},
                    "frames_rendered_median": statistics.median(run["frames"] for run in runs),
                    "final_render_ms_median": round(statistics.median(run["finishMs"] for run in runs), 1),
                    "stored_answer_ms_median": {
                        "first_shown": round(statistics.median(w["firstMs"] for w in whole), 1),
                        "wholly_shown": round(statistics.median(w["wholeMs"] for w in whole), 1),
                        "longest_task": statistics.median(w["longest"] for w in whole),
                    },
                }
            ),
            flush=True,
        )
    browser.close()


# Installed before the page's own scripts (by the DevTools protocol, so the page's CSP does not apply):
# records when the message named by the URL's #last= is first inside the list's view, and every long task.
WATCH = """(() => {
    const last = new URLSearchParams(location.hash.slice(1)).get("last");
    window.__bench = { shownMs: null, longTasks: [] };
    new PerformanceObserver((list) => {
        for (const entry of list.getEntries()) window.__bench.longTasks.push(entry.duration);
    }).observe({ type: "longtask", buffered: true });
    if (!last) return;
    const look = () => {
        const item = document.querySelector(`li.message[data-message-id="${last}"]`);
        const list = document.querySelector("#messages");
        if (item && list) {
            const box = item.getBoundingClientRect(), view = list.getBoundingClientRect();
            if (box.height > 0 && box.top < view.bottom && box.bottom > view.top) {
                window.__bench.shownMs = performance.now();
                return;
            }
        }
        requestAnimationFrame(look);
    };
    requestAnimationFrame(look);
})()"""

# Scrolls the list up `step` px per frame until the chat's first message is on screen.
SCROLL_TO_TOP = """async ([first, step]) => {
    const list = document.querySelector("#messages");
    window.__bench.longTasks = [];
    let most = 0, frames = 0;
    const started = performance.now();
    for (;;) {
        most = Math.max(most, document.querySelectorAll("li.message").length);
        const item = document.querySelector(`li.message[data-message-id="${first}"]`);
        if (item && list.scrollTop === 0) break;
        if (performance.now() - started > 600000) throw new Error("the first message never showed");
        list.scrollTop = Math.max(0, list.scrollTop - step);
        await new Promise((resolve) => requestAnimationFrame(resolve));
        frames++;
    }
    await new Promise((resolve) => setTimeout(resolve, 200));
    const tasks = window.__bench.longTasks;
    return { ms: performance.now() - started, frames, mostMessageNodes: most, longTasks: tasks.length,
             longestTaskMs: tasks.length ? Math.max(...tasks) : 0,
             over50: tasks.filter((d) => d > 50).length };
}"""


async def seed_chat(store: MemoryStore, user: str, chat_id: str, messages: int) -> tuple[str, str]:
    """``messages`` messages on one branch (questions and Markdown answers, a second apart, ending now);
    the ids of the first and the last."""
    start = datetime.now(UTC) - timedelta(seconds=messages + 5)
    chain: list[Message] = []
    for i in range(messages):
        role = Role.USER if i % 2 == 0 else Role.ASSISTANT
        content = f"Question {i // 2}: how does step {i} work?" if role is Role.USER else SECTION
        chain.append(
            Message(
                message_id=str(new_id(start + timedelta(seconds=i))),
                chat_id=chat_id,
                role=role,
                content=content,
                parent_id=chain[-1].message_id if chain else None,
                model="bench" if role is Role.ASSISTANT else None,
                finish_reason=FinishReason.STOP if role is Role.ASSISTANT else None,
                usage=Usage(40, 0, 120) if role is Role.ASSISTANT else None,
            )
        )
    for message in chain:  # one by one: a parent is checked stored when its child is appended
        await store.append_message(user, message)
    return chain[0].message_id, chain[-1].message_id


# Trace event names (Chromium's devtools.timeline) grouped by what the time went to in a long task.
TRACE_KINDS = {
    "script": {
        "FunctionCall",
        "EvaluateScript",
        "v8.callFunction",
        "TimerFire",
        "FireAnimationFrame",
        "EventDispatch",
        "FireIdleCallback",
        "BlinkScheduler_PerformMicrotaskCheckpoint",
    },
    "style": {"UpdateLayoutTree", "RecalculateStyles"},
    "layout": {"Layout", "UpdateLayerTree", "PrePaint"},
    "paint": {"Paint", "PaintImage", "Layerize", "CompositeLayers", "Commit", "UpdateLayer"},
    "parse HTML": {"ParseHTML", "ParseAuthorStyleSheet"},
    "GC": {"MajorGC", "MinorGC", "BlinkGC.AtomicPhase"},
}


def long_task_profile(trace: bytes, over_ms: float = 50.0) -> dict:
    """Where the renderer's main thread spent its long tasks (over ``over_ms``): each kind's self time
    (time in its events less their children of other kinds), summed over those tasks, and the longest
    task's own split. Self times of nested events of the same kind are not counted twice."""
    events = json.loads(trace)["traceEvents"]
    main = {
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name" and e["args"].get("name") == "CrRendererMain"
    }
    spans = sorted(
        (e for e in events if e.get("ph") == "X" and (e["pid"], e["tid"]) in main and "dur" in e),
        key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]),
    )
    kind_of = {name: kind for kind, names in TRACE_KINDS.items() for name in names}
    kind_of.update({e["name"]: "GC" for e in spans if e["name"].startswith("V8.GC")})
    tasks = [e for e in spans if e["name"] == "RunTask" and e["dur"] > over_ms * 1000]
    totals: dict[str, float] = {}
    longest: dict[str, float] = {}
    for task in tasks:
        end = task["ts"] + task["dur"]
        inside = [
            e
            for e in spans
            if e["pid"] == task["pid"] and task["ts"] <= e["ts"] and e["ts"] + e["dur"] <= end
        ]
        split: dict[str, float] = {}
        stack: list[tuple[float, str]] = []  # (end, kind) of the enclosing classified events
        for event in inside:
            kind = kind_of.get(event["name"])
            while stack and stack[-1][0] <= event["ts"]:
                stack.pop()
            if kind is None:
                continue
            outer = stack[-1][1] if stack else None
            if outer != kind:
                split[kind] = split.get(kind, 0.0) + event["dur"] / 1000
                if outer is not None:
                    split[outer] -= event["dur"] / 1000
            stack.append((event["ts"] + event["dur"], kind))
        split["other"] = task["dur"] / 1000 - sum(split.values())
        for kind, ms in split.items():
            totals[kind] = totals.get(kind, 0.0) + ms
        if task["dur"] == max(t["dur"] for t in tasks):
            longest = split
    rounded = lambda split: {kind: round(ms, 1) for kind, ms in sorted(split.items(), key=lambda kv: -kv[1])}  # noqa: E731
    return {
        "long_tasks": len(tasks),
        "ms_by_kind": rounded(totals),
        "longest_task_ms_by_kind": rounded(longest),
    }


def script_profile(profile: dict) -> dict:
    """A V8 CPU profile (the DevTools protocol's) summed by the file each sample's function is in."""
    by_id = {node["id"]: node["callFrame"] for node in profile["nodes"]}
    deltas = profile["timeDeltas"]
    by_file: dict[str, float] = {}
    for sample, delta in zip(profile["samples"], [*deltas[1:], 0], strict=True):
        frame = by_id[sample]
        name = frame["url"].rsplit("/", 1)[-1] or frame["functionName"] or "(idle)"
        by_file[name] = by_file.get(name, 0.0) + delta / 1000
    return {name: round(ms) for name, ms in sorted(by_file.items(), key=lambda kv: -kv[1])[:8]}


def heap_and_nodes(cdp) -> tuple[float, int]:
    """The tab's JS heap in use (MiB) after a garbage collection, and its DOM node count."""
    cdp.send("HeapProfiler.collectGarbage")
    metrics = {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}
    return round(metrics["JSHeapUsedSize"] / 2**20, 1), int(metrics["Nodes"])


def long_chat(args: argparse.Namespace, playwright) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="bench-chat-page-"))
    with Launcher(run_dir, echo=lambda line: None) as launcher:
        keys = generate_keys(run_dir / "dev-jwt")
        cql_port = free_port()
        mesh_args = argparse.Namespace(engines=1, tokens_per_s=1000.0)
        _, _, orchestrators = start_mesh(launcher, mesh_args, run_dir, keys, cql_port=cql_port)
        url = start_door(launcher, orchestrators, run_dir, keys)
        user = "bench-reader"
        token = keys.mint(user, "enterprise")
        chats = {}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as client:
            for size in (args.small_chat, args.chat_messages):
                chats[size] = client.post("/v1/chats", json={"title": f"{size} messages"}).json()["chat_id"]

        async def seed() -> dict[int, tuple[str, str]]:
            store = await MemoryStore.connect(StoreConfig(port=cql_port, keyspace="chatmesh_bench"))
            try:
                return {size: await seed_chat(store, user, chat, size) for size, chat in chats.items()}
            finally:
                await store.close()

        # Playwright's sync API runs an event loop in this thread: the seeding has one of its own.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            ends = pool.submit(asyncio.run, seed()).result()
        browser = playwright.chromium.launch(executable_path=chromium_path(), args=CHROMIUM_FLAGS)
        context = browser.new_context(viewport={"width": 1280, "height": 800})
        context.add_init_script(WATCH)
        page = context.new_page()
        cdp = context.new_cdp_session(page)
        cdp.send("Performance.enable")
        page.goto(f"{url}/#token={token}")
        page.wait_for_selector(f"#whoami:has-text('{user}')")
        for size, chat_id in chats.items():
            first, last = ends[size]
            opens = []
            for attempt in range(args.opens + 1):  # the first is cold
                page.goto(f"{url}/?chat={chat_id}&open={attempt}#last={last}")
                page.wait_for_function("() => window.__bench.shownMs !== null", timeout=30_000)
                opens.append(page.evaluate("window.__bench.shownMs"))
            warm = opens[1:]
            heap_open, nodes_open = heap_and_nodes(cdp)
            messages_open = page.locator("li.message").count()
            if args.profile:
                browser.start_tracing(
                    page=page,
                    categories=[
                        "toplevel",
                        "devtools.timeline",
                        "disabled-by-default-devtools.timeline",
                        "blink.user_timing",
                    ],
                )
                cdp.send("Profiler.enable")
                cdp.send("Profiler.start")
            scroll = page.evaluate(SCROLL_TO_TOP, [first, args.scroll_px])
            profile = None
            if args.profile:
                trace = browser.stop_tracing()
                Path(f"{args.profile}.{size}.json").write_bytes(trace)
                profile = long_task_profile(trace)
                profile["self_ms_by_file"] = script_profile(cdp.send("Profiler.stop")["profile"])
            heap_top, nodes_top = heap_and_nodes(cdp)
            print(
                json.dumps(
                    {
                        "case": f"a {size}-message chat through Envoy",
                        "last_shown_ms": {
                            "p50": round(statistics.median(warm), 1),
                            "min": round(min(warm), 1),
                            "max": round(max(warm), 1),
                            "cold": round(opens[0], 1),
                            "opens": len(warm),
                        },
                        "opened": {
                            "message_nodes": messages_open,
                            "dom_nodes": nodes_open,
                            "js_heap_mib": heap_open,
                        },
                        "scroll_to_top": {
                            "px_per_frame": args.scroll_px,
                            "ms": round(scroll["ms"]),
                            "frames": scroll["frames"],
                            "most_message_nodes": scroll["mostMessageNodes"],
                            "long_tasks": scroll["longTasks"],
                            "over_50_ms": scroll["over50"],
                            "longest_task_ms": scroll["longestTaskMs"],
                        },
                        "at_top": {"dom_nodes": nodes_top, "js_heap_mib": heap_top},
                        **({"profile": profile} if profile else {}),
                    }
                ),
                flush=True,
            )
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cases", default="render,long-chat", help="comma-separated: render, long-chat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--table-rows", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=5.0, help="pause between tokens")
    parser.add_argument("--chat-messages", type=int, default=5000)
    parser.add_argument("--small-chat", type=int, default=100)
    parser.add_argument("--opens", type=int, default=10, help="warm opens of each chat")
    parser.add_argument(
        "--scroll-px", type=int, default=400, help="scrolled up per frame (400: a fast fling, ~24,000 px/s)"
    )
    parser.add_argument(
        "--profile",
        metavar="PREFIX",
        help="trace each scroll to the top: where its long tasks' time went (PREFIX.<messages>.json: "
        "the trace, for the DevTools Performance panel)",
    )
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    print(json.dumps({"machine": machine(), "load_average": os.getloadavg()}), flush=True)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        if "render" in cases:
            render_cases(args, playwright)
        if "long-chat" in cases:
            long_chat(args, playwright)


if __name__ == "__main__":
    main()
