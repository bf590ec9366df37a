"""A long chat in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService: it
opens on its branch's newest page (GetBranch) with skeletons while it loads, older pages come in by cursor
as the reader scrolls up without moving what is on screen, only messages near the view are in the page
(a bounded number, up to the first message), a branch point on an older page has its version arrows (the
page gives each message's versions) and switching there opens that version's branch, and a message sent
shows at once, before the server has it."""

from __future__ import annotations

import pytest

from tests.front_door.chat_page import LIVE, chat_page, live_text
from tests.front_door.conftest import ScriptedFrontDoor
from tests.front_door.helpers import send as send_rest
from tests.front_door.helpers import wait_for

TURNS = 110  # 220 messages: pages of 100, 100 and 20 (within the enterprise burst of sends)
PAGE = 100
MAX_NODES = 60  # message elements in the page at once, with the window's margins, for any chat length
AT_END = "(() => { const l = document.querySelector('#messages'); return l.scrollHeight - l.scrollTop - l.clientHeight < 2; })()"
# The first message in view (its id) and where its top is on the screen.
TOP_IN_VIEW = """(() => {
    const list = document.querySelector('#messages').getBoundingClientRect();
    const item = [...document.querySelectorAll('li.message')].find((m) => m.getBoundingClientRect().bottom > list.top);
    return [item.dataset.messageId, item.getBoundingClientRect().top];
})()"""


def branch_calls(front_door: ScriptedFrontDoor, chat_id: str) -> list:
    """The GetBranch calls of one chat (the scripted service is the session's: other tests' pages call it
    too)."""
    return [call for call in front_door.scripted.calls_to("GetBranch") if call.request.chat_id == chat_id]


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
        with front_door.scripted.delay("GetBranch", 1.5):
            page.goto(f"{front_door.url}/?chat={long_chat}")
            page.wait_for_selector("#messages li.skeleton")
            assert page.get_attribute("#messages", "aria-busy") == "true"
            page.wait_for_selector(f"li.message.user:has-text('turn {TURNS - 1} ')")
        # The branch's newest page, from the chat's newest message; only what is near the view is shown.
        [opened] = branch_calls(front_door, long_chat)
        assert (opened.request.leaf_message_id, opened.request.page_size) == ("", PAGE)
        assert 0 < page.locator("li.message").count() <= MAX_NODES
        assert page.locator("li.message.user:has-text('turn 0 ')").count() == 0
        assert page.get_attribute("#messages", "aria-busy") == "false"
        assert page.evaluate(AT_END), "the chat opens at its end"

        # Scrolled to the top, the next older page arrives above, and the message that was at the top
        # stays where the reader saw it.
        for pages in (2, 3):
            with front_door.scripted.delay("GetBranch", 0.5):
                page.evaluate("document.querySelector('#messages').scrollTop = 0")
                wait_for(lambda n=pages: len(branch_calls(front_door, long_chat)) == n, what="an older page")
                top_id, before = page.evaluate(TOP_IN_VIEW)
            page.wait_for_function(
                "() => parseFloat(document.querySelector('#messages > .spacer').style.height) > 0"
            )
            after = page.evaluate(
                f"document.querySelector('[data-message-id=\"{top_id}\"]').getBoundingClientRect().top"
            )
            assert abs(after - before) <= 2, (before, after)
            assert page.locator("li.message").count() <= MAX_NODES
        # The pages were asked for with the cursor of the page before, for the same branch.
        tokens = [call.request.page_token for call in branch_calls(front_door, long_chat)]
        assert tokens[0] == "" and all(tokens[1:]) and len(set(tokens)) == 3

        # On to the first message: however much is loaded, the page holds a bounded number of them.
        for _ in range(100):
            if page.locator("li.message.user:has-text('turn 0 ')").count():
                break
            page.evaluate("document.querySelector('#messages').scrollTop = 0")
            page.wait_for_timeout(50)
            assert page.locator("li.message").count() <= MAX_NODES
        page.wait_for_selector("li.message.user:has-text('turn 0 ')", state="attached")
        assert page.locator("li.message").count() <= MAX_NODES
        assert page.is_hidden("#older"), "nothing older is left to load"


@pytest.fixture
def old_branch_point(front_door: ScriptedFrontDoor, user: str) -> tuple[str, str]:
    """A chat whose first answer was regenerated, then 60 more turns on the regenerated one: the branch
    point lies beyond the newest 100 messages. The chat and its first (older) answer's text."""
    with front_door.client(user, "enterprise") as client:
        wait_for(lambda: client.get("/v1/chats").status_code == 200, what="the front door to answer")
        chat_id = client.post("/v1/chats", json={"title": "An old branch point"}).json()["chat_id"]
        events = send_rest(client, chat_id, "turn first !tokens 2 0")
        [first] = [e.data["assistant_message_id"] for e in events if e.event == "done"]
        with client.stream(
            "POST", f"/v1/chats/{chat_id}/messages/{first}/regenerate", json={"idempotency_key": "again"}
        ) as reply:
            assert reply.status_code == 200, reply.read()
            reply.read()
        for turn in range(60):
            send_rest(client, chat_id, f"turn {turn} !tokens 1 0")
        stored = client.get(f"/v1/chats/{chat_id}/messages/{first}/branch").json()["messages"]
    return chat_id, stored[0]["content"]


def test_a_branch_point_on_an_older_page_has_its_arrows_and_switches_to_that_versions_branch(
    front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, old_branch_point: tuple[str, str]
):
    chat_id, first_answer = old_branch_point
    with chat_page(front_door, browser_context, user, tmp_path, "old-branch-point", "enterprise") as page:
        page.goto(f"{front_door.url}/?chat={chat_id}")
        page.wait_for_selector("li.message.user:has-text('turn 59 ')")
        # Up to the first message: the older page gives the regenerated answer's versions.
        for _ in range(100):
            if page.locator("li.message.user:has-text('turn first')").count():
                break
            page.evaluate("document.querySelector('#messages').scrollTop = 0")
            page.wait_for_timeout(50)
        regenerated = page.locator("li.message.assistant").filter(
            has=page.locator(".meta span", has_text="2 / 2")
        )
        regenerated.wait_for()
        # The older version, by keyboard: its branch (the answer alone) replaces the one on screen.
        regenerated.get_by_role("button", name="Previous version").focus()
        page.keyboard.press("Enter")
        page.wait_for_selector("li.message.assistant .meta span:has-text('1 / 2')")
        assert page.locator("li.message.user").all_text_contents() == ["turn first !tokens 2 0"]
        assert page.locator("li.message.assistant .content").all_text_contents() == [first_answer]
        [switched] = [call for call in branch_calls(front_door, chat_id) if call.request.newest_leaf]
        assert switched.request.page_token == ""
        # And back to the newer one: its newest message, the chat's last turn, at the end.
        page.get_by_role("button", name="Next version").click()
        page.wait_for_selector("li.message.user:has-text('turn 59 ')")


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


def test_a_reader_who_scrolled_up_stays_put_while_an_answer_streams_and_one_at_the_end_follows_it(
    front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, long_chat: str
):
    with chat_page(front_door, browser_context, user, tmp_path, "long-chat-streaming", "enterprise") as page:
        page.goto(f"{front_door.url}/?chat={long_chat}")
        page.wait_for_selector(f"li.message.user:has-text('turn {TURNS - 1} ')")
        page.fill("#prompt", "A long answer, please. !tokens 400 15")
        page.press("#prompt", "Enter")
        page.wait_for_selector(LIVE)
        # At the end, the list follows the answer as it grows.
        grown = page.evaluate("document.querySelector('#messages').scrollHeight")
        page.wait_for_function(f"() => document.querySelector('#messages').scrollHeight > {grown + 200}")
        assert page.evaluate(AT_END)
        # Scrolled up, the reader's place holds while the answer goes on growing below.
        page.evaluate("document.querySelector('#messages').scrollTop -= 600")
        page.wait_for_timeout(100)  # the scroll's own frame
        top_id, before = page.evaluate(TOP_IN_VIEW)
        length = len(live_text(page))
        page.wait_for_function(f"() => document.querySelector('{LIVE}').textContent.length > {length + 300}")
        after = page.evaluate(
            f"document.querySelector('[data-message-id=\"{top_id}\"]').getBoundingClientRect().top"
        )
        assert abs(after - before) <= 2, (before, after)
        assert not page.evaluate(AT_END)
        page.wait_for_selector("#live", state="detached", timeout=30_000)
