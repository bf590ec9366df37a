"""Shared pytest setup. Fixtures that start real services live in tests/fixtures/, one module each."""

pytest_plugins: list[str] = [
    "tests.fixtures.cassandra",
    "tests.fixtures.engines",
    "tests.fixtures.model",
    "tests.fixtures.router",
    "tests.fixtures.orchestrator",
    "tests.fixtures.envoy",
    "tests.fixtures.front_door",
    "tests.fixtures.browser",
]
