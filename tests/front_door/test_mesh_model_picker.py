"""The chat page's model picker in headless Chromium against the real mesh with two chat models (null
engines: SmolLM2's tokenizer under two names, each its own pool): a new chat is created for the picked
model and answered by it; picking the other model switches the chat, as stored; reopening a chat shows
its model picked."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher
from tests.fixtures.front_door import FrontDoor, start_front_door
from tests.fixtures.orchestrator import MeshFactory
from tests.front_door.chat_page import chat_page, send

ANSWER_TOKENS = 8


@dataclass(frozen=True)
class PickerMesh:
    door: FrontDoor
    primary: str
    other: str


@pytest.fixture(scope="module")
def picker_mesh(
    tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys, start_mesh: MeshFactory
) -> Iterator[PickerMesh]:
    mesh, primary, other = start_mesh.twin_pools(titles=False, default_max_tokens=ANSWER_TOKENS)
    with Launcher(tmp_path_factory.mktemp("picker-door"), echo=lambda line: None) as launcher:
        door = start_front_door(launcher, dev_jwt_keys, [mesh.orchestrator.port])
        yield PickerMesh(door, primary, other)


def stored_models(door: FrontDoor, user: str) -> tuple[str | None, list[str]]:
    """The newest chat's recorded model, and the models of its answers, oldest first."""
    with door.client(user) as client:
        chat = client.get("/v1/chats").json()["chats"][0]
        stored = client.get(f"/v1/chats/{chat['chat_id']}/messages").json()["messages"]
    return chat["model"], [m["model"] for m in reversed(stored) if m["role"] == "assistant"]


def test_the_picked_model_answers_a_new_chat_and_picking_another_switches_it(
    picker_mesh: PickerMesh, browser_context, user: str, tmp_path
) -> None:
    door, primary, other = picker_mesh.door, picker_mesh.primary, picker_mesh.other
    with chat_page(door, browser_context, user, tmp_path, "mesh-model-picker") as page:
        picker = page.locator("#model")
        picker.wait_for(state="visible")  # the list loads beside the chats and the caller's tier
        assert picker.locator("option").all_text_contents() == ["Default model", primary, other]
        picker.select_option(other)
        send(page, "Hello.")
        page.wait_for_selector("#live", state="detached")
        assert stored_models(door, user) == (other, [other])

        picker.select_option(primary)
        send(page, "Again.")
        page.wait_for_selector("#live", state="detached")
        assert stored_models(door, user) == (primary, [other, primary])

        # Reopened, the chat shows its model picked.
        page.reload()
        # An answer, not a loading skeleton (also `li.message.assistant`): the chat is open by then.
        page.wait_for_selector("li.message.assistant:not(.skeleton)")
        assert page.locator("#model").input_value() == primary
