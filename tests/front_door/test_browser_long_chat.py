"""A long chat in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService: it
opens on its newest page of messages with skeletons while they load, older pages come in as the reader
scrolls up without moving what is on screen, and a message sent shows at once, before the server has it."""

from __future__ import annotations

import pytest

from tests.front_door.chat_page import chat_page
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.helpers import send as send_rest
from tests.front_door.helpers import wait_for

TURNS = 110  # 220 messages: pages of 100, 100 and 20 (within the enterprise burst of sends)
PAGE = 100


@pytest.fixture
def long_chat(front_door: ScriptedFrontDoor, user: str) -> str:
    with front_door.client(user, "enterprise") as client:
        wait_for(lambda: client.get("/v1/chats").status_code == 200, what="the front door to answer")
        created = client.post("/v1/chats", json={"title": "A long chat"})
        assert created.status_code == 201, created.text
        chat_id = created.json()["chat_id"]
        for turn in range(TURNS):
            send_rest(client, chat_id, f"turn {turn} !tokens 1 0")
    return chat_id


def test_a_long_chat_opens_on_its_newest_page_and_loads_older_ones_on_scroll_up(
    front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, long_chat: str
):
    with chat_page(front_door, browser_context, user, tmp_path, "long-chat", "enterprise") as page:
        with front_door.scripted.delay("ListMessages", 1.5):
            page.goto(f"{front_door.url}/?chat={long_chat}")
            page.wait_for_selector("#messages li.skeleton")
            assert page.get_attribute("#messages", "aria-busy") == "true"
            page.wait_for_selector(f"li.message.user:has-text('turn {TURNS - 1} ')")
        assert page.locator("li.message").count() == PAGE
        assert page.locator("li.message.user:has-text('turn 0 ')").count() == 0
        assert page.get_attribute("#messages", "aria-busy") == "false"

        # Scrolled to the top, the next older page arrives above, and the message that was at the top
        # stays where the reader saw it.
        for loaded in (2 * PAGE, 2 * TURNS):
            top = page.locator("li.message").first
            top_id = top.get_attribute("data-message-id")
            page.evaluate("document.querySelector('#messages').scrollTop = 0")
            before = page.evaluate(
                f"document.querySelector('[data-message-id=\"{top_id}\"]').getBoundingClientRect().top"
            )
            page.wait_for_function(f"() => document.querySelectorAll('li.message').length === {loaded}")
            after = page.evaluate(
                f"document.querySelector('[data-message-id=\"{top_id}\"]').getBoundingClientRect().top"
            )
            assert abs(after - before) <= 2, (before, after)
        page.wait_for_selector("li.message.user:has-text('turn 0 ')", state="attached")
        assert page.locator("li.older").count() == 0, "nothing older is left to load"


def test_a_sent_message_shows_before_the_server_has_it(page_for_send):
    page, front_door = page_for_send
    with front_door.scripted.delay("SendMessage", 1.5):
        page.fill("#prompt", "Shown at once !tokens 2 10")
        page.press("#prompt", "Enter")
        page.wait_for_selector("li.message.user:has-text('Shown at once')", timeout=1000)
        assert page.get_attribute("#messages", "aria-busy") == "true"
    page.wait_for_selector("li.message.assistant:not(#live)")


@pytest.fixture
def page_for_send(front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path):
    with chat_page(front_door, browser_context, user, tmp_path, "optimistic-send") as page:
        yield page, front_door
