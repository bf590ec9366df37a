"""An identity provider's keys fetched from its jwks_uri (chatmesh/remote_jwks.py) by a TokenVerifier:
a real HTTP server on 127.0.0.1 publishes them; rotation, a provider down, and unknown key ids."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from chatmesh import remote_jwks
from chatmesh.identity import IdentityConfig, TokenVerifier, Unauthenticated
from localmesh.dev_jwt import ISSUER, DevKeys, generate_keys


class Jwks:
    """What the provider publishes now (None: it answers 503), and how often it was asked."""

    def __init__(self, document: dict | None) -> None:
        self.document, self.fetches = document, 0


@pytest.fixture
def published(tmp_path: Path) -> Iterator[tuple[Jwks, str]]:
    jwks = Jwks(None)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            jwks.fetches += 1
            body = json.dumps(jwks.document).encode() if jwks.document else b"down"
            self.send_response(200 if jwks.document else 503)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield jwks, f"http://127.0.0.1:{server.server_address[1]}/jwks"
    server.shutdown()


def keys_of(*pairs: DevKeys) -> dict:
    return {"keys": [key for pair in pairs for key in json.loads(pair.jwks_path.read_text())["keys"]]}


def verifier_for(url: str) -> TokenVerifier:
    return TokenVerifier.from_config(IdentityConfig(jwks_url=url, jwt_issuer=ISSUER))


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_rotation_at_the_provider_is_fetched_when_a_token_names_the_new_key(
    published: tuple[Jwks, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    jwks, url = published
    old, new = generate_keys(tmp_path / "old"), generate_keys(tmp_path / "new")
    jwks.document = keys_of(old)
    verifier = verifier_for(url)
    assert verifier.identity(bearer(old.mint("alice"))).user_id == "alice"
    assert jwks.fetches == 1
    # The provider rotates: a token signed with the new key fetches the set again, once.
    monkeypatch.setattr(remote_jwks, "JWKS_MIN_REFETCH_S", 0.0)
    jwks.document = keys_of(new)
    assert verifier.identity(bearer(new.mint("bob"))).user_id == "bob"
    assert jwks.fetches == 2
    # The old key is gone from the set: the tokens it proved are forgotten and refused.
    with pytest.raises(Unauthenticated, match="not valid"):
        verifier.identity(bearer(old.mint("alice")))


def test_unknown_key_ids_do_not_flood_the_provider(published: tuple[Jwks, str], tmp_path: Path):
    jwks, url = published
    known, stranger = generate_keys(tmp_path / "known"), generate_keys(tmp_path / "stranger")
    jwks.document = keys_of(known)
    verifier = verifier_for(url)
    for _ in range(20):
        with pytest.raises(Unauthenticated):
            verifier.identity(bearer(stranger.mint("mallory")))
    # The fetch at start only: another waits JWKS_MIN_REFETCH_S, however many key ids are unknown.
    assert jwks.fetches == 1
    assert verifier.identity(bearer(known.mint("alice"))).user_id == "alice"


def test_a_provider_down_keeps_the_keys_that_worked_and_one_down_at_start_is_tried_again(
    published: tuple[Jwks, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    jwks, url = published
    keys = generate_keys(tmp_path / "keys")
    # Down when the service starts: it starts anyway, and fetches on the first token.
    verifier = verifier_for(url)
    monkeypatch.setattr(remote_jwks, "JWKS_MIN_REFETCH_S", 0.0)
    jwks.document = keys_of(keys)
    assert verifier.identity(bearer(keys.mint("alice"))).user_id == "alice"
    # Down later, when the keys age: the keys that worked stay.
    monkeypatch.setattr(remote_jwks, "JWKS_MAX_AGE_S", 0.0)
    jwks.document = None
    assert verifier.identity(bearer(keys.mint("bob"))).user_id == "bob"
    assert jwks.fetches >= 3


def test_one_source_of_keys_and_an_http_url():
    with pytest.raises(ValueError, match="exclusive"):
        TokenVerifier.from_config(IdentityConfig(jwks_file="/x.json", jwks_url="https://idp.example/jwks"))
    with pytest.raises(ValueError, match="http"):
        TokenVerifier.from_config(IdentityConfig(jwks_url="file:///etc/jwks.json"))
