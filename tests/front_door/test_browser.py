"""The chat page in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService
(not the orchestrator) where a test scripts the service: regenerate, rename and delete, and a clear message
when rate limited. The walk through a streamed answer (stream, stop, reload and resume) runs against the
real mesh in test_mesh_browser.py. Screenshots are kept as test artifacts."""

from __future__ import annotations

import grpc
import pytest

from tests.front_door.chat_page import chat_page, last_answer, send
from tests.front_door.conftest import ScriptedFrontDoor


@pytest.fixture
def page(front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path):
    with chat_page(front_door, browser_context, user, tmp_path, user) as page:
        yield page


def test_regenerate_shows_both_versions(page):
    send(page, "Pick a word !tokens 3 10")
    page.wait_for_selector("#live", state="detached")
    last_answer(page).get_by_role("button", name="Regenerate").click()
    page.wait_for_selector("#live", state="detached")
    page.wait_for_selector("li.message.assistant .meta span:has-text('2 / 2')")
    last_answer(page).get_by_role("button", name="Previous version").click()
    page.wait_for_selector("li.message.assistant .meta span:has-text('1 / 2')")


def test_rate_limited_send_shows_a_clear_message(page, front_door: ScriptedFrontDoor):
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
