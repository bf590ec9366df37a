"""Driving the chat page in headless Chromium (tests/fixtures/browser.py): open it signed in, send, watch
the live answer grow. Shared by the page tests against the scripted service and against the real mesh."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.fixtures.browser import artifacts_dir
from tests.fixtures.front_door import FrontDoor

LIVE = "#live .content"


@contextmanager
def chat_page(
    door: FrontDoor, browser_context, user: str, tmp_path: Path, shot_name: str, tier: str = "pro"
) -> Iterator[object]:
    """A page signed in as ``user`` of ``tier``; on the way out a full-page screenshot is kept as a test artifact
    (``<artifacts>/<shot_name>.png``) and any JavaScript error fails the test."""
    page = browser_context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{door.url}/#token={door.envoy.token(user, tier)}")
    page.wait_for_selector(f"#whoami:has-text('{user}')")
    yield page
    shot = tmp_path / "chat-page.png"
    page.screenshot(path=str(shot), full_page=True)
    shutil.copy(shot, artifacts_dir() / f"{shot_name}.png")
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
