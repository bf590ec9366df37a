"""The chat page's rendering in Chromium: the main thread's longest task while a Markdown answer streams
into edge/static/render.js (StreamingAnswer, at most one render per animation frame), and the cost of
showing a whole stored answer (a big table fills in a chunk of rows per task), for an ordinary answer and for a huge table.

The page's own files are served with the edge's security headers (edge.pages: so under its CSP) by a
small stdlib HTTP server; tokens are fed in the page by a timer at a set pace, so the numbers are the
renderer's, not the network's. Run it under the machine-wide lock:

    flock /tmp/chatmesh-bench.lock .venv/bin/python bench/bench_chat_page.py --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import statistics
import threading

from edge.pages import SECURITY_HEADERS, STATIC_DIR
from meshkit.launcher import free_port
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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--table-rows", type=int, default=2000)
    parser.add_argument("--interval-ms", type=float, default=5.0, help="pause between tokens")
    args = parser.parse_args()
    url = serve()
    from playwright.sync_api import sync_playwright

    cases = {
        f"stream {args.tokens} Markdown tokens": ordinary_tokens(args.tokens),
        f"stream a {args.table_rows}-row table": table_tokens(args.table_rows),
    }
    with sync_playwright() as playwright:
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
                        "final_render_ms_median": round(
                            statistics.median(run["finishMs"] for run in runs), 1
                        ),
                        "stored_answer_ms_median": {
                            "first_shown": round(statistics.median(w["firstMs"] for w in whole), 1),
                            "wholly_shown": round(statistics.median(w["wholeMs"] for w in whole), 1),
                            "longest_task": statistics.median(w["longest"] for w in whole),
                        },
                    }
                )
            )
        browser.close()


if __name__ == "__main__":
    main()
