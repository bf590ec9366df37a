"""Fixtures of the orchestrator tests: ChatService clients for fresh users, closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from tests.fixtures.orchestrator import ChatClient, Mesh


@pytest.fixture
async def connect() -> AsyncIterator[Callable[..., ChatClient]]:
    """``connect(address, user=None)``: a client (a fresh user unless named), closed after the test."""
    made: list[ChatClient] = []

    def make(address: str, user: str | None = None) -> ChatClient:
        made.append(ChatClient(address, user))
        return made[-1]

    yield make
    for client in made:
        await client.close()


@pytest.fixture
def client(mesh: Mesh, connect: Callable[..., ChatClient]) -> ChatClient:
    """A fresh user on the shared mesh's orchestrator."""
    return connect(mesh.orchestrator.address)


@pytest.fixture
def engines_idle(mesh: Mesh) -> None:
    """For tests that count the shared mesh's engine requests: none is left from earlier tests (the
    title every completed first exchange asks for is generated after that test has ended)."""
    mesh.wait_until_engines_idle()


@pytest.fixture
def router_required() -> None:
    """For modules whose tests generate answers: ``pytestmark = pytest.mark.usefixtures(...)``."""
