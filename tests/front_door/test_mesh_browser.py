"""The chat page in headless Chromium against the real mesh (Envoy -> edge -> orchestrator -> router ->
null engines at 200 tokens/s, Cassandra; null engines, not the real model): send a message and watch the
tokens stream in, stop it, then reload the page mid-answer and see it resume to the end. What the page
shows is checked against what the mesh stored. The screenshot is kept as a test artifact
(``.run/test-artifacts/mesh-chat-walk.png``)."""

from __future__ import annotations

from tests.fixtures.front_door import MESH_DOOR_DEFAULT_MAX_TOKENS, MeshFrontDoor
from tests.front_door.chat_page import LIVE, chat_page, last_answer, live_text, send, watch_stream
from tests.front_door.helpers import send as send_rest
from tests.front_door.helpers import wait_for


def stored_answers(door: MeshFrontDoor, user: str) -> list[dict]:
    """The newest chat's assistant messages, oldest first, as the API returns them."""
    with door.client(user) as client:
        chat_id = client.get("/v1/chats").json()["chats"][0]["chat_id"]
        stored = client.get(f"/v1/chats/{chat_id}/messages").json()["messages"]
    return [m for m in reversed(stored) if m["role"] == "assistant"]


def test_send_stream_stop_and_reload_mid_answer_resumes(
    mesh_front_door: MeshFrontDoor, browser_context, user: str, tmp_path
):
    with chat_page(mesh_front_door, browser_context, user, tmp_path, "mesh-chat-walk") as page:
        # Tokens appear a few at a time, not all at once. (The first ones arrive together: the engine
        # starts while the orchestrator stores the question, and the first delta waits for that.)
        send(page, "Tell me a story.")
        lengths = watch_stream(page, until_words=150)
        assert len(lengths) >= 4, lengths
        assert page.is_visible("#stop")

        # Stop: the run is cancelled, the engines let go of it, the partial answer is kept as stored.
        page.click("#stop")
        page.wait_for_selector("#live", state="detached")
        stopped = last_answer(page)
        assert "cancelled" in stopped.locator(".usage").text_content()
        assert page.is_hidden("#stop")
        wait_for(lambda: mesh_front_door.mesh.engine_requests() == 0, what="the engines to drop the run")
        [cancelled] = stored_answers(mesh_front_door, user)
        assert cancelled["finish_reason"] == "cancelled"
        assert stopped.locator(".content").text_content() == cancelled["content"] != ""

        # Reload mid-answer: the page resumes the same run (Last-Event-ID) and shows the whole answer.
        send(page, "And another one.")
        watch_stream(page, until_words=6)
        before_reload = live_text(page)
        page.reload()
        page.wait_for_selector(LIVE)
        assert live_text(page).strip().startswith(before_reload.strip())
        page.wait_for_selector("#live", state="detached", timeout=30_000)
        finished = stored_answers(mesh_front_door, user)[-1]
        assert finished["finish_reason"] == "length"
        assert last_answer(page).locator(".content").text_content() == finished["content"]
        assert (
            f"{MESH_DOOR_DEFAULT_MAX_TOKENS} completion tokens"
            in last_answer(page).locator(".usage").text_content()
        )
        # The reloaded page resumed through GET /v1/runs/{id}/events (Envoy's access log shows it).
        path = f"/v1/runs/{finished['run_id']}/events"
        wait_for(lambda: path in mesh_front_door.access_log(), what="the resume in Envoy's access log")


def test_search_in_the_sidebar_finds_titles_and_messages_and_opens_the_chat(
    mesh_front_door: MeshFrontDoor, browser_context, user: str, tmp_path
):
    with mesh_front_door.client(user) as client:
        kept = client.post("/v1/chats", json={"title": "Walrus facts"}).json()["chat_id"]
        talk = client.post("/v1/chats", json={"title": "Zoo"}).json()["chat_id"]
        send_rest(client, talk, "Do walruses sleep in water?", options={"max_tokens": 2})
        gone = client.post("/v1/chats", json={"title": "Walrus drafts"}).json()["chat_id"]
        assert client.delete(f"/v1/chats/{gone}").status_code == 204
    with mesh_front_door.client(f"{user}-other") as other:
        other.post("/v1/chats", json={"title": "Walrus secrets"})
    with chat_page(mesh_front_door, browser_context, user, tmp_path, "mesh-search") as page:
        page.fill("#search-input", "walrus")
        page.press("#search-input", "Enter")
        page.wait_for_selector("#search-results li")
        results = page.locator("#search-results li").all_text_contents()
        assert len(results) == 1 and "Walrus facts" in results[0] and "matched the title" in results[0]
        assert page.is_hidden("#chat-list")
        page.fill("#search-input", "walruses water")
        page.press("#search-input", "Enter")
        page.wait_for_selector("#search-results li:has-text('Do walruses sleep in water?')")
        page.locator("#search-results li button").first.click()
        page.wait_for_selector("li.message.user:has-text('Do walruses sleep in water?')")
        assert page.url.endswith(f"chat={talk}")
        page.fill("#search-input", "")
        page.wait_for_selector("#chat-list li:has-text('Walrus facts')")
        assert page.is_hidden("#search-results") and kept
