"""Rendered answers in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService
(``!answer``: a text the test chose, token by token): Markdown with highlighted code, a copy button,
lists, tables and links, rendered while it streams; tool steps shown above an answer as they run; a
hostile answer (scripts, ``javascript:`` links,
event attributes, a remote image, a huge table) that runs nothing, fetches nothing and leaves the page
responsive; and the Content-Security-Policy the edge serves the pages with."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.front_door.chat_page import chat_page, last_answer, send
from tests.front_door.conftest import ScriptedFrontDoor

MARKDOWN = (
    "## Steps\n\n"
    "1. first *step*\n2. second **step**\n\n"
    "```python\ndef add(x):\n    return x + 1\n```\n\n"
    "| name | count |\n|------|------:|\n| apples | 3 |\n| pears | 5 |\n\n"
    "See [the docs](https://example.com/docs) for more.\n"
)
TABLE_ROWS = 2000


def pieces(text: str, size: int) -> list[str]:
    """Tokens of ``size`` characters: tags, links and fences arrive split across deltas."""
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.fixture
def page(front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, request):
    with chat_page(front_door, browser_context, user, tmp_path, request.node.name[:60]) as page:
        yield page


@pytest.fixture
def elsewhere() -> Iterator[tuple[str, list[str]]]:
    """Another origin (a real HTTP server on another port) and the paths anyone asked it for."""
    asked: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/gif")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_pages_and_their_files_carry_a_strict_content_security_policy(front_door: ScriptedFrontDoor):
    for path in ("/", "/ops", "/static/index.html", "/static/app.js", "/static/vendor/marked/marked.esm.js"):
        reply = httpx.get(f"{front_door.url}{path}")
        assert reply.status_code == 200, path
        policy = {
            directive.split()[0]: directive.split()[1:]
            for directive in reply.headers["content-security-policy"].split("; ")
        }
        assert policy["script-src"] == ["'self'"], path
        assert policy["img-src"] == ["'self'"], path
        assert policy["object-src"] == ["'none'"] and policy["base-uri"] == ["'none'"], path
        assert policy["frame-ancestors"] == ["'none'"], path
        assert policy["default-src"] == ["'none'"], path
        assert reply.headers["x-content-type-options"] == "nosniff", path
        assert reply.headers["referrer-policy"] == "no-referrer", path
    # The test-only accessibility checker is never served.
    assert httpx.get(f"{front_door.url}/static/vendor/axe-core/axe.min.js").status_code == 404


def test_a_markdown_answer_streams_in_rendered(page, front_door: ScriptedFrontDoor, browser_context):
    browser_context.grant_permissions(["clipboard-read", "clipboard-write"], origin=front_door.url)
    with front_door.scripted.answering("markdown", pieces(MARKDOWN, 4)):
        send(page, "Show me Markdown !answer markdown 25")
        # While the answer streams its finished blocks are rendered once and kept: the heading seen
        # early is the same element once the code block has arrived after it.
        page.wait_for_selector("#live ol")
        heading = page.query_selector("#live h2")
        assert heading.text_content() == "Steps"
        page.wait_for_selector("#live pre code.language-python")
        assert heading.evaluate("h => h.isConnected") and page.query_selector("#live") is not None
        page.wait_for_selector("#live", state="detached")

    answer = last_answer(page).locator(".content")
    assert answer.locator("h2").text_content() == "Steps"
    assert answer.locator("ol > li").all_text_contents() == ["first step", "second step"]
    assert answer.locator("ol em").text_content() == "step" and answer.locator("ol strong").count() == 1
    code = answer.locator("pre code.hljs.language-python")
    assert code.text_content() == "def add(x):\n    return x + 1"
    assert code.locator(".hljs-keyword").first.text_content() == "def"  # highlighted
    assert answer.locator("table tbody tr").count() == 2
    assert answer.locator("table tbody tr").last.locator("td").all_text_contents() == ["pears", "5"]
    link = answer.get_by_role("link", name="the docs")
    assert link.get_attribute("href") == "https://example.com/docs"
    assert link.get_attribute("target") == "_blank"
    assert link.get_attribute("rel") == "noopener noreferrer"

    answer.get_by_role("button", name="Copy code").click()
    page.wait_for_selector(".copy-code:has-text('Copied')")
    assert page.evaluate("navigator.clipboard.readText()") == "def add(x):\n    return x + 1"


HOSTILE = (
    "# A hostile answer\n\n"
    "<script>window.pwned = 'script tag'</script>\n\n"
    "<img src=x onerror=\"window.pwned = 'onerror'\">\n\n"
    "[a javascript link](javascript:window.pwned='link') [upper](JAVASCRIPT:window.pwned='upper') "
    "[data](data:text/html,<script>parent.pwned=1</script>) <javascript:window.pwned='autolink'>\n\n"
    '<a href="javascript:window.pwned=1" onclick="window.pwned=2">raw link</a>\n\n'
    '<div onmouseover="window.pwned=\'hover\'" style="position:fixed;inset:0">cover</div>\n\n'
    "![tracking pixel]({elsewhere}/pixel.gif?chat=secret)\n\n"
    '<iframe src="{elsewhere}/frame"></iframe> <svg onload="window.pwned=\'svg\'"></svg>\n\n'
    "<style>body {{ background: url({elsewhere}/style.gif) }}</style>\n\n"
    "```html\n<script>window.pwned = 'code block'</script>\n```\n\n"
    "A [plain link](https://example.com/ok).\n\n"
)

# Collected in the page from before the answer starts: elements that could run or fetch something,
# CSP violations, and the longest main-thread task.
WATCH = """() => {
    window.watched = { dangerous: [], violations: [], longestTaskMs: 0 };
    const risky = (el) => ["SCRIPT", "IMG", "IFRAME", "OBJECT", "EMBED", "STYLE", "svg", "LINK", "BASE"]
        .includes(el.tagName) || [...el.attributes].some((a) => a.name.startsWith("on") || a.name === "style"
        || /^\\s*(javascript|data):/i.test(a.value));
    new MutationObserver((records) => {
        for (const record of records) for (const node of record.addedNodes) {
            if (node.nodeType !== 1) continue;
            for (const el of [node, ...node.querySelectorAll("*")]) if (risky(el)) window.watched.dangerous.push(el.outerHTML.slice(0, 120));
        }
    }).observe(document.querySelector("#messages"), { childList: true, subtree: true });
    document.addEventListener("securitypolicyviolation", (e) => window.watched.violations.push(e.blockedURI));
    new PerformanceObserver((list) => {
        for (const entry of list.getEntries()) window.watched.longestTaskMs = Math.max(window.watched.longestTaskMs, entry.duration);
    }).observe({ type: "longtask" });
}"""


def test_a_hostile_answer_runs_nothing_fetches_nothing_and_the_page_stays_responsive(
    page, front_door: ScriptedFrontDoor, elsewhere
):
    origin, asked = elsewhere
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    table = "| id | name | value | note |\n|---|---|---|---|\n" + "".join(
        f"| {i} | row {i} | {i * 7} | <b onclick=x>note</b> |\n" for i in range(TABLE_ROWS)
    )
    tokens = [*pieces(HOSTILE.format(elsewhere=origin), 3), *table.splitlines(keepends=True), "\nThe end."]
    page.evaluate(WATCH)
    with front_door.scripted.answering("hostile", tokens):
        send(page, "Be hostile !answer hostile 1")
        # Responsive while the table streams: keys typed now land in the box at once.
        page.wait_for_selector("#live table, #live pre.streaming-plain")
        page.type("#prompt", "still typing")
        assert page.input_value("#prompt") == "still typing"
        page.wait_for_selector("#live", state="detached", timeout=90_000)

    answer = last_answer(page).locator(".content")
    assert page.evaluate("window.pwned") is None
    watched = page.evaluate("window.watched")
    assert watched["dangerous"] == [] and watched["violations"] == []
    assert asked == [], "the page fetched something from another origin"
    assert [url for url in requested if not url.startswith(front_door.url)] == []
    # Raw HTML is shown as text, the links that could run code have no href, the rest open safely.
    assert "<script>window.pwned = 'script tag'</script>" in answer.text_content()
    assert answer.locator("a", has_text="a javascript link").get_attribute("href") is None
    assert answer.locator("a", has_text="upper").get_attribute("href") is None
    assert answer.locator("a", has_text="data").get_attribute("href") is None
    pixel = answer.get_by_role("link", name="image: tracking pixel")
    assert pixel.get_attribute("href") == f"{origin}/pixel.gif?chat=secret"
    for link in answer.locator("a[href]").all():
        assert link.get_attribute("href").startswith(("https://", "http://127.0.0.1"))
        assert link.get_attribute("target") == "_blank"
        assert link.get_attribute("rel") == "noopener noreferrer"
    # A big table is shown a chunk of rows per task: all of them in the end.
    page.wait_for_function(
        f"() => document.querySelectorAll('li.message.assistant table tbody tr').length === {TABLE_ROWS}"
    )
    assert answer.locator("table b").count() == 0
    print(f"longest main-thread task while streaming {len(tokens)} tokens: {watched['longestTaskMs']:.0f} ms")


def test_tool_steps_show_above_the_answer_as_they_run_and_stay_once_it_is_stored(page):
    send(page, "Look it up !tool calculator OK !tool search TIMEOUT !tokens 3 20")
    # Each step shows running, then how it ended, above the answer's text.
    page.wait_for_selector(
        "#live .steps li[data-outcome='running'] summary:has-text('Tool calculator: running')"
    )
    page.wait_for_selector("#live .steps li[data-outcome='ok'] summary:has-text('Tool calculator: done')")
    page.wait_for_selector("#live", state="detached")
    answer = last_answer(page)
    steps = answer.locator(".steps li summary")
    assert steps.all_text_contents() == ["Tool calculator: done", "Tool search: timed out"]
    assert answer.locator(".steps + .content").count() == 1  # above the text
    # A step opens from the keyboard on its call and the tool's result, both shown as text.
    steps.first.focus()
    page.keyboard.press("Enter")
    result = answer.locator(".steps li").first.locator("figure", has_text="Result").locator("pre")
    assert result.text_content() == "<b>calculator</b> said 4"
    assert (
        answer.locator(".steps li")
        .first.locator("figure", has_text="Arguments")
        .locator("pre")
        .text_content()
        == '{"q": 1}'
    )
    assert answer.locator(".steps b").count() == 0
