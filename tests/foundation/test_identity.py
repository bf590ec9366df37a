"""The services' own proof of who calls (chatmesh/identity.py): a bearer token verified against the JWKS
Envoy uses, never a header. Real RS256 keys made here; no service involved."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import time
from pathlib import Path

import jwt
import pytest
from cryptography.hazmat.primitives import serialization

from chatmesh import identity as identity_module
from chatmesh.identity import Identity, IdentityConfig, TokenVerifier, Unauthenticated
from localmesh.dev_jwt import ISSUER, DevKeys, generate_keys


@pytest.fixture
def keys(tmp_path: Path) -> DevKeys:
    return generate_keys(tmp_path / "keys")


@pytest.fixture
def verifier(keys: DevKeys) -> TokenVerifier:
    return TokenVerifier.from_config(IdentityConfig(jwks_file=str(keys.jwks_path), jwt_issuer=ISSUER))


def bearer(token: str) -> str:
    return f"Bearer {token}"


def test_a_valid_token_proves_its_user_and_tier(verifier: TokenVerifier, keys: DevKeys):
    assert verifier.identity(bearer(keys.mint("alice", "enterprise"))).user_id == "alice"
    assert verifier.identity(bearer(keys.mint("alice", "enterprise"))).tier == "enterprise"
    # An unknown tier is the lowest, never trusted.
    assert verifier.identity(bearer(keys.mint("bob", "root"))).tier == "free"
    metadata = [("x-chatmesh-user-id", "victim"), ("authorization", bearer(keys.mint("carol", "pro")))]
    assert verifier.identity_from_metadata(metadata).user_id == "carol"


def test_identity_headers_without_a_token_prove_nothing(verifier: TokenVerifier):
    forged = [("x-chatmesh-user-id", "victim"), ("x-chatmesh-tier", "enterprise")]
    with pytest.raises(Unauthenticated, match="no bearer token"):
        verifier.identity_from_metadata(forged)
    for value in (None, "", "Bearer", "Bearer   ", "Basic dXNlcjpwdw=="):
        with pytest.raises(Unauthenticated):
            verifier.identity(value)


def test_tokens_not_minted_for_chatmesh_are_refused(verifier: TokenVerifier, keys: DevKeys, tmp_path: Path):
    stranger = generate_keys(tmp_path / "stranger")
    refused = {
        "another key pair": stranger.mint("alice"),
        "another audience": keys.mint("alice", audience="billing"),
        "another issuer": keys.mint("alice", issuer="someone-else"),
        "garbage": "not.a.jwt",
    }
    for why, token in refused.items():
        with pytest.raises(Unauthenticated, match="not valid for chatmesh"):
            verifier.identity(bearer(token))
            pytest.fail(why)
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.identity(bearer(keys.mint("alice", ttl_s=-120)))


def test_a_token_cannot_choose_its_algorithm(verifier: TokenVerifier, keys: DevKeys):
    claims = {"iss": ISSUER, "aud": "chatmesh", "sub": "mallory", "exp": int(time.time()) + 60}
    # alg "none", and HS256 keyed with the public key anyone has (the classic RS/HS confusion).
    body = _b64(json.dumps(claims).encode())
    unsigned = f"{_b64(json.dumps({'alg': 'none', 'kid': keys.kid}).encode())}.{body}."
    signing_input = f"{_b64(json.dumps({'alg': 'HS256', 'kid': keys.kid}).encode())}.{body}"
    public_pem = (
        serialization.load_pem_private_key(keys.private_key_path.read_bytes(), password=None)
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    mac = hmac.new(public_pem, signing_input.encode(), hashlib.sha256).digest()
    confused = f"{signing_input}.{_b64(mac)}"
    for token in (unsigned, confused):
        with pytest.raises(Unauthenticated):
            verifier.identity(bearer(token))


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def test_a_token_must_name_a_user_and_expire(verifier: TokenVerifier, keys: DevKeys):
    private = keys.private_key_path.read_bytes()
    now = int(time.time())
    base = {"iss": ISSUER, "aud": "chatmesh", "sub": "alice", "exp": now + 60}
    for claims in ({**base, "sub": " "}, {k: v for k, v in base.items() if k != "exp"}):
        token = jwt.encode(claims, private, algorithm="RS256", headers={"kid": keys.kid})
        with pytest.raises(Unauthenticated):
            verifier.identity(bearer(token))


def test_a_rotated_jwks_is_picked_up_without_a_restart(
    verifier: TokenVerifier, keys: DevKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(identity_module, "JWKS_RECHECK_S", 0.0)
    new = generate_keys(tmp_path / "new")
    with pytest.raises(Unauthenticated):
        verifier.identity(bearer(new.mint("alice")))
    # Rotation: publish both keys, as a Secret update does (the file is replaced, not edited).
    both = {
        "keys": json.loads(keys.jwks_path.read_text())["keys"] + json.loads(new.jwks_path.read_text())["keys"]
    }
    staged = keys.jwks_path.with_suffix(".new")
    staged.write_text(json.dumps(both))
    os.replace(staged, keys.jwks_path)
    assert verifier.identity(bearer(new.mint("alice"))).user_id == "alice"
    assert verifier.identity(bearer(keys.mint("bob"))).user_id == "bob"
    # A broken file mid-rotation keeps the keys that worked.
    keys.jwks_path.write_text("{")
    assert verifier.identity(bearer(new.mint("alice"))).user_id == "alice"


def test_a_service_without_usable_keys_refuses_to_start(tmp_path: Path):
    with pytest.raises(ValueError, match="--jwks-file is required"):
        TokenVerifier.from_config(IdentityConfig())
    with pytest.raises(ValueError, match="--jwks-file"):
        TokenVerifier.from_config(IdentityConfig(jwks_file=str(tmp_path / "missing.json")))
    (tmp_path / "empty.json").write_text('{"keys": []}')
    with pytest.raises(ValueError, match="--jwks-file"):
        TokenVerifier.from_config(IdentityConfig(jwks_file=str(tmp_path / "empty.json")))


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The tokens whose signature is checked, in order."""
    checked: list[str] = []
    real_decode = jwt.decode
    monkeypatch.setattr(
        identity_module.jwt,
        "decode",
        lambda token, *a, **kw: checked.append(token) or real_decode(token, *a, **kw),
    )
    return checked


def test_a_verified_token_is_remembered_until_it_expires(
    verifier: TokenVerifier, keys: DevKeys, decodes: list[str]
):
    # Expired, but 2 s short of the clock skew every verifier allows: valid for 2 s more.
    token = bearer(keys.mint("alice", "pro", ttl_s=2 - identity_module.CLOCK_SKEW_S))
    assert verifier.identity(token) == verifier.identity(token) == Identity("alice", "pro")
    assert len(decodes) == 1
    time.sleep(2.2)
    with pytest.raises(Unauthenticated, match="expired"):
        verifier.identity(token)
    assert len(decodes) == 2


def test_a_key_removed_from_the_jwks_revokes_its_remembered_tokens(
    verifier: TokenVerifier, keys: DevKeys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(identity_module, "JWKS_RECHECK_S", 0.0)
    token = bearer(keys.mint("alice"))
    assert verifier.identity(token).user_id == "alice"
    # The key pair is replaced (a leaked key's rotation): its tokens stop proving anything at once.
    new = generate_keys(tmp_path / "new")
    staged = keys.jwks_path.with_suffix(".new")
    staged.write_text(new.jwks_path.read_text())
    os.replace(staged, keys.jwks_path)
    with pytest.raises(Unauthenticated, match="not valid for chatmesh"):
        verifier.identity(token)
    assert verifier.identity(bearer(new.mint("alice"))).user_id == "alice"


def test_remembered_tokens_are_bounded(
    verifier: TokenVerifier, keys: DevKeys, decodes: list[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(identity_module, "VERIFIED_TOKENS", 3)
    tokens = [keys.mint(f"user-{i}") for i in range(5)]
    for token in tokens:
        verifier.identity(bearer(token))
    # The three used last are remembered; the first was forgotten and is checked again.
    for token in (tokens[4], tokens[2], tokens[0]):
        verifier.identity(bearer(token))
    assert decodes == [*tokens, tokens[0]]
