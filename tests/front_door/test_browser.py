"""The chat page in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService
(not the orchestrator): send, watch tokens stream, stop, reload mid-answer and see it resume, regenerate,
and a clear message when rate limited. Screenshots are kept as test artifacts."""

from __future__ import annotations

import shutil
import time

import grpc
import pytest

from tests.fixtures.browser import artifacts_dir
from tests.front_door.conftest import FrontDoor
from tests.front_door.scripted_chat_service import scripted_text

LIVE = "#live .content"


@pytest.fixture
def page(front_door: FrontDoor, browser_context, user: str, tmp_path):
    page = browser_context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{front_door.url}/#token={front_door.envoy.token(user)}")
    page.wait_for_selector(f"#whoami:has-text('{user}')")
    yield page
    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    shutil.copy(shot, artifacts_dir() / f"{user}.png")
    page.close()
    assert errors == [], f"JavaScript errors on the page: {errors}"


def live_text(page) -> str:
    return page.eval_on_selector(LIVE, "el => el.textContent") if page.query_selector(LIVE) else ""


def watch_stream(page, until_words: int, timeout_s: float = 15.0) -> list[int]:
    """Polls the live answer until it has ``until_words`` words; returns the lengths it went through."""
    lengths: list[int] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        words = len(live_text(page).split())
        if not lengths or words != lengths[-1]:
            lengths.append(words)
        if words >= until_words:
            return lengths
        page.wait_for_timeout(30)
    raise AssertionError(f"the answer stopped growing at {lengths[-1:]} words")


def send(page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    page.wait_for_selector(LIVE)


def last_answer(page):
    return page.locator("li.message.assistant").last


def test_tokens_stream_stop_and_reload_resumes(page, front_door: FrontDoor):
    # Tokens appear a few at a time, not all at once.
    send(page, "Tell me a story !tokens 60 50")
    lengths = watch_stream(page, until_words=20)
    assert len(lengths) >= 4, lengths  # seen growing in several steps
    assert page.is_visible("#stop")

    # Stop: the run is cancelled and the partial answer is kept, marked cancelled.
    page.click("#stop")
    page.wait_for_selector("#live", state="detached")
    answer = last_answer(page)
    assert "cancelled" in answer.locator(".usage").text_content()
    assert 0 < len(answer.locator(".content").text_content().split()) < 60
    assert page.is_hidden("#stop")

    # Reload mid-answer: the page resumes the same run and ends with the whole answer, no gap, no repeat.
    send(page, "And another one !tokens 40 60")
    watch_stream(page, until_words=6)
    before_reload = live_text(page)
    page.reload()
    page.wait_for_selector(LIVE)
    assert live_text(page).startswith(before_reload.strip())
    page.wait_for_selector("#live", state="detached", timeout=20_000)
    assert last_answer(page).locator(".content").text_content() == scripted_text(40)
    assert "40 completion tokens" in last_answer(page).locator(".usage").text_content()
    resumed = [c for c in front_door.scripted.calls_to("StreamRun") if c.request.after_seq > 0]
    assert resumed, "the reload should have resumed with Last-Event-ID > 0"

    # The token budget in the header counts the answers (ScriptedChatService's usage numbers).
    page.wait_for_selector("#usage:has-text('of 1,000,000 tokens used (pro)')")
    # The chat shows up in the sidebar, titled after its first message.
    assert page.locator("#chat-list li").first.text_content().startswith("Tell me a story")


def test_regenerate_shows_both_versions(page):
    send(page, "Pick a word !tokens 3 10")
    page.wait_for_selector("#live", state="detached")
    last_answer(page).get_by_role("button", name="Regenerate").click()
    page.wait_for_selector("#live", state="detached")
    page.wait_for_selector("li.message.assistant .meta span:has-text('2 / 2')")
    last_answer(page).get_by_role("button", name="Previous version").click()
    page.wait_for_selector("li.message.assistant .meta span:has-text('1 / 2')")


def test_rate_limited_send_shows_a_clear_message(page, front_door: FrontDoor):
    with front_door.scripted.failing(
        "SendMessage", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget spent", retry_after_s=9
    ):
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        banner = page.wait_for_selector("#banner:has-text('rate limited')")
    assert "Try again in 9 s" in banner.text_content()
    # What was typed is not lost.
    page.wait_for_function("document.querySelector('#prompt').value === 'hello'")


def test_rename_and_delete_from_the_sidebar(page):
    send(page, "A chat to tidy away !tokens 2 10")
    page.wait_for_selector("#live", state="detached")
    page.once("dialog", lambda dialog: dialog.accept("Tidy title"))
    page.get_by_role("button", name="Rename A chat to tidy away").click()
    page.wait_for_selector("#chat-list li:has-text('Tidy title')")
    assert page.text_content("#chat-title") == "Tidy title"
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete Tidy title").click()
    page.wait_for_selector("#chat-list li:has-text('Tidy title')", state="detached")
    assert page.text_content("#chat-title") == "New chat"
