"""The chat page in headless Chromium, through the real Envoy and edge, answered by ScriptedChatService
(not the orchestrator) where a test scripts the service: regenerate, rename and delete, and a clear message
when rate limited. The walk through a streamed answer (stream, stop, reload and resume) runs against the
real mesh in test_mesh_browser.py. Screenshots are kept as test artifacts."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import grpc
import pytest

from meshkit.launcher import Launcher
from tests.fixtures.front_door import start_front_door
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
    # A spent budget asks for a wait far beyond a busy server's: the page says so at once, no retries.
    sends = len(front_door.scripted.calls_to("SendMessage"))
    with front_door.scripted.failing(
        "SendMessage", grpc.StatusCode.RESOURCE_EXHAUSTED, "budget spent", retry_after_s=3600
    ):
        page.fill("#prompt", "hello")
        page.press("#prompt", "Enter")
        banner = page.wait_for_selector("#banner:has-text('rate limited')")
    assert "Try again in 3600 s" in banner.text_content()
    assert len(front_door.scripted.calls_to("SendMessage")) == sends + 1
    # What was typed is not lost.
    page.wait_for_function("() => document.querySelector('#prompt').value === 'hello'")


def test_an_answer_refused_after_its_question_was_stored_is_retried_with_the_same_key(
    page, front_door: ScriptedFrontDoor
):
    # The stream opens (200, `started`), then the run ends busy before its first delta: the page waits
    # the retry delay and sends the same request again, idempotency key included, which the orchestrator
    # answers with a new run for the question already stored.
    sends = len(front_door.scripted.calls_to("SendMessage"))
    send(page, "Full queue? !refusedonce RESOURCE_EXHAUSTED !tokens 3 10")
    page.wait_for_selector("#banner:has-text('Our servers are busy. Retrying in 1 s (retry 1 of 4)')")
    page.wait_for_selector("li.message.assistant:not(#live)")
    calls = front_door.scripted.calls_to("SendMessage")[sends:]
    assert len(calls) == 2
    assert calls[0].request.idempotency_key and calls[0].request == calls[1].request
    assert page.is_hidden("#banner")


def test_rename_and_delete_from_the_sidebar(page):
    send(page, "A chat to tidy away !tokens 2 150")
    page.wait_for_selector("#live", state="detached")
    page.once("dialog", lambda dialog: dialog.accept("Tidy title"))
    page.get_by_role("button", name="Rename A chat to tidy away").click()
    page.wait_for_selector("#chat-list li:has-text('Tidy title')")
    assert page.text_content("#chat-title") == "Tidy title"
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Delete Tidy title").click()
    page.wait_for_selector("#chat-list li:has-text('Tidy title')", state="detached")
    assert page.text_content("#chat-title") == "New chat"


@pytest.fixture(scope="module")
def roomy_front_door(
    front_door: ScriptedFrontDoor, dev_jwt_keys, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ScriptedFrontDoor]:
    """Another Envoy and edge over the same scripted service, with the default rate limits: the test
    front door's free tier (2 sends per 30 s) would answer the third retry itself."""
    with Launcher(tmp_path_factory.mktemp("roomy-front-door"), echo=lambda line: None) as launcher:
        door = start_front_door(launcher, dev_jwt_keys, [front_door.scripted_port])
        yield ScriptedFrontDoor(
            door.envoy,
            door.edge,
            launcher,
            scripted=front_door.scripted,
            scripted_port=front_door.scripted_port,
        )


# Busy servers: the page retries by itself, never sooner than Retry-After (1 s here), linearly for paid
# tiers (1, 2, 3 s) and exponentially for the free tier (1, 2, 4 s), counting down in the banner.
@pytest.mark.parametrize(
    ("tier", "code", "waits"),
    [
        ("free", grpc.StatusCode.RESOURCE_EXHAUSTED, [1, 2, 4]),  # 429
        ("pro", grpc.StatusCode.UNAVAILABLE, [1, 2, 3]),  # 503
    ],
)
def test_a_busy_server_is_retried_with_the_tiers_backoff_and_a_countdown(
    roomy_front_door: ScriptedFrontDoor, browser_context, user: str, tmp_path, tier, code, waits
):
    front_door = roomy_front_door
    with chat_page(front_door, browser_context, user, tmp_path, f"busy-{tier}", tier) as page:
        page.evaluate(
            """() => {
                window.banners = [];
                const banner = document.querySelector("#banner");
                new MutationObserver(() => window.banners.push(banner.hidden ? "" : banner.textContent))
                    .observe(banner, { childList: true, attributes: true, characterData: true, subtree: true });
            }"""
        )
        with front_door.scripted.failing("SendMessage", code, "busy", retry_after_s=1, times=len(waits)):
            send_at = len(front_door.scripted.calls_to("SendMessage"))
            page.fill("#prompt", "Are you there? !tokens 3 10")
            page.press("#prompt", "Enter")
            page.wait_for_selector("#banner:has-text('Our servers are busy. Retrying in')")
            page.wait_for_selector("li.message.assistant:not(#live)", timeout=(sum(waits) + 10) * 1000)
        banners = page.evaluate("window.banners")
        assert page.is_hidden("#banner")
    calls = front_door.scripted.calls_to("SendMessage")[send_at:]
    assert len(calls) == len(waits) + 1, "each refusal was retried, and the last try got through"
    gaps = [later.at - earlier.at for earlier, later in itertools.pairwise(calls)]
    for gap, wait in zip(gaps, waits, strict=True):
        assert wait - 0.2 <= gap <= wait + 1.5, (gaps, waits)
    for retry, wait in enumerate(waits, 1):
        assert f"Our servers are busy. Retrying in {wait} s (retry {retry} of 4)." in banners, banners
    # The countdown ticks down each second.
    assert f"Our servers are busy. Retrying in {waits[-1] - 1} s (retry {len(waits)} of 4)." in banners


def test_the_page_shows_which_model_answered_and_that_it_was_degraded(page):
    send(page, "Busy? !degraded SmolLM2-135M-Instruct-lite !tokens 30 50")
    page.wait_for_selector(
        "#live .meta:has-text('SmolLM2-135M-Instruct-lite (a lighter model: our servers are busy)')"
    )
    page.wait_for_selector("#live", state="detached")
    assert "SmolLM2-135M-Instruct-lite" in last_answer(page).text_content()
