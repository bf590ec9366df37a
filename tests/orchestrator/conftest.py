"""Fixtures of the orchestrator tests: a ChatService client for a fresh user on the shared mesh."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.fixtures.orchestrator import ChatClient, Mesh


@pytest.fixture
async def client(mesh: Mesh) -> AsyncIterator[ChatClient]:
    client = ChatClient(mesh.orchestrator.address)
    yield client
    await client.close()
