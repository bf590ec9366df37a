"""The chat page and the operations page for people who do not use a mouse or do not see the screen, in
headless Chromium through the real Envoy and edge, answered by ScriptedChatService: the live region
speaks an answer once, complete, never token by token; a keyboard-only walk sends, stops, regenerates,
flips between versions and switches chats with focus always visible and never lost; and axe-core
(vendored for the tests under tests/fixtures/vendor, injected here, never served) finds no serious or
critical violation on either page, light or dark."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatmesh.identity import OPERATOR_ROLE
from tests.fixtures.browser import artifacts_dir
from tests.front_door.chat_page import chat_page, last_answer, send, watch_stream
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.test_browser_rendering import MARKDOWN, pieces

AXE = Path(__file__).resolve().parents[1] / "fixtures" / "vendor" / "axe-core" / "axe.min.js"


@pytest.fixture
def page(front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, request):
    with chat_page(front_door, browser_context, user, tmp_path, request.node.name[:60]) as page:
        yield page


def test_the_live_region_speaks_the_answer_once_it_is_complete(page):
    assert page.get_attribute("#messages", "aria-live") is None
    page.evaluate(
        """() => {
            window.spoken = [];
            const region = document.querySelector("#announcer");
            new MutationObserver(() => window.spoken.push(region.textContent))
                .observe(region, { childList: true, characterData: true, subtree: true });
        }"""
    )
    send(page, "Talk to me !tokens 40 20")
    watch_stream(page, until_words=10)
    assert [text for text in page.evaluate("window.spoken") if text] == [], "spoke before the end"
    page.wait_for_selector("#live", state="detached")
    answer = " ".join(last_answer(page).locator(".content").text_content().split())
    assert [text for text in page.evaluate("window.spoken") if text] == [f"Answer: {answer}"]
    assert page.get_attribute("#announcer", "role") == "status"


def focused(page) -> dict:
    return page.evaluate(
        """() => {
            const el = document.activeElement;
            return { id: el.id, label: el.getAttribute("aria-label") || el.textContent.trim(),
                     outline: getComputedStyle(el).outlineStyle };
        }"""
    )


def tab_to(page, label: str, backwards: bool = False, limit: int = 40) -> None:
    """Presses Tab (or Shift+Tab) until the element named ``label`` has the focus, which is visible."""
    for _ in range(limit):
        page.keyboard.press("Shift+Tab" if backwards else "Tab")
        now = focused(page)
        if now["label"] == label or now["id"] == label:
            assert now["outline"] != "none", f"no visible focus on {label}"
            return
    raise AssertionError(f"{label} is not reachable with the keyboard")


def test_a_keyboard_only_walk(page, front_door: ScriptedFrontDoor, user: str):
    with front_door.client(user) as client:
        other = client.post("/v1/chats", json={"title": "Another chat"}).json()["chat_id"]
    page.reload()
    page.wait_for_selector("#chat-list li:has-text('Another chat')")
    # The skip link leads to the message box.
    tab_to(page, "Skip to message box")
    page.keyboard.press("Enter")
    assert focused(page)["id"] == "prompt"

    # Send with Enter, then stop with the keyboard: focus comes back to the message box.
    page.keyboard.type("A long one !tokens 400 30")
    page.keyboard.press("Enter")
    page.wait_for_selector("#stop:not([disabled])")
    tab_to(page, "stop")
    page.keyboard.press("Enter")
    page.wait_for_selector("#live", state="detached")
    assert "cancelled" in last_answer(page).locator(".usage").text_content()
    assert focused(page)["id"] == "prompt"

    # Regenerate the answer, then flip between its two versions; focus stays on the arrow pressed.
    tab_to(page, "Regenerate", backwards=True)
    page.keyboard.press("Enter")
    page.wait_for_selector("#live")
    page.wait_for_selector("#live", state="detached")
    page.wait_for_selector("li.message.assistant .meta span:has-text('2 / 2')")
    tab_to(page, "Previous version", backwards=True)
    page.keyboard.press("Enter")
    page.wait_for_selector("li.message.assistant .meta span:has-text('1 / 2')")
    assert focused(page)["label"] == "Previous version"
    page.keyboard.press("Tab")
    assert focused(page)["label"] == "Next version"
    page.keyboard.press("Enter")
    page.wait_for_selector("li.message.assistant .meta span:has-text('2 / 2')")
    assert focused(page)["label"] == "Next version"

    # Switch chats from the sidebar: the chat opens and the focus stays on its entry.
    tab_to(page, "Another chat", backwards=True, limit=60)
    page.keyboard.press("Enter")
    page.wait_for_selector("#chat-title:has-text('Another chat')")
    assert page.url.endswith(f"?chat={other}")
    assert focused(page)["label"] == "Another chat"
    assert page.get_attribute(f"#chat-list [data-focus-key='open:{other}']", "aria-current") == "page"


def axe_violations(page, name: str) -> list[dict]:
    """axe-core's serious and critical violations on the page as it is (WCAG 2.x A and AA rules)."""
    page.evaluate(AXE.read_text())
    results = page.evaluate(
        """async () => (await axe.run(document, {
            runOnly: { type: "tag", values: ["wcag2a", "wcag2aa", "wcag21a", "wcag21aa", "best-practice"] },
        })).violations.map((v) => ({ id: v.id, impact: v.impact, nodes: v.nodes.map((n) => n.target.join(" ")) }))"""
    )
    page.screenshot(path=str(artifacts_dir() / f"axe-{name}.png"), full_page=True)
    return [v for v in results if v["impact"] in ("serious", "critical")]


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_nothing_serious_on_the_chat_page(page, front_door: ScriptedFrontDoor, scheme):
    page.emulate_media(color_scheme=scheme)
    with front_door.scripted.answering("markdown", pieces(MARKDOWN, 40)):
        send(page, "Show me Markdown !tool calculator OK !tool search ERROR !answer markdown 5")
        page.wait_for_selector("#live", state="detached")
    page.locator("li.message.assistant .steps summary").first.click()  # a tool step open, scanned too
    send(page, "And now a long one !tokens 400 30")  # scanned mid-answer, with Stop showing
    page.wait_for_selector("#stop:not([disabled])")
    assert axe_violations(page, f"chat-{scheme}") == []
    page.click("#stop")
    page.wait_for_selector("#live", state="detached")


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_axe_finds_nothing_serious_on_the_operations_page(
    front_door: ScriptedFrontDoor, browser_context, user: str, scheme
):
    token = front_door.envoy.keys.mint(f"{user}-ops", "pro", role=OPERATOR_ROLE)
    page = browser_context.new_page()
    try:
        page.emulate_media(color_scheme=scheme)
        page.goto(f"{front_door.url}/ops#token={token}")
        page.wait_for_selector("#dashboard:not([hidden])")
        assert axe_violations(page, f"ops-{scheme}") == []
    finally:
        page.close()
