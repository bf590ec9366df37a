"""Dev JWT tooling: keys made once with a private key only the owner can read, tokens that verify
against the published JWKS, and the CLI behind `make token`."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import jwt
import pytest

from chatmesh.identity import JWT_AUDIENCE
from localmesh.dev_jwt import DIR_ENV, ISSUER, ensure_keys

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_keys_are_made_once_and_the_private_key_is_private(tmp_path):
    keys = ensure_keys(tmp_path / "keys")
    assert stat.S_IMODE(keys.private_key_path.stat().st_mode) == 0o600
    again = ensure_keys(tmp_path / "keys")
    assert again.kid == keys.kid
    assert again.private_key_path.read_bytes() == keys.private_key_path.read_bytes()


def test_tokens_verify_against_the_jwks(tmp_path):
    keys = ensure_keys(tmp_path)
    token = keys.mint("alice", "pro", ttl_s=60)
    (jwk,) = json.loads(keys.jwks_path.read_text())["keys"]
    assert "d" not in jwk  # the JWKS holds the public key only
    public = jwt.PyJWK(jwk).key
    claims = jwt.decode(token, public, algorithms=["RS256"], audience=JWT_AUDIENCE, issuer=ISSUER)
    assert (claims["sub"], claims["tier"]) == ("alice", "pro")
    assert jwt.get_unverified_header(token)["kid"] == keys.kid
    with pytest.raises(jwt.ExpiredSignatureError):
        jwt.decode(keys.mint("alice", ttl_s=-60), public, algorithms=["RS256"], audience=JWT_AUDIENCE)


def test_cli_prints_a_token_for_the_user_and_tier(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "localmesh.dev_jwt",
            "--user",
            "bob",
            "--tier",
            "enterprise",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    claims = jwt.decode(out, options={"verify_signature": False})
    assert (claims["sub"], claims["tier"]) == ("bob", "enterprise")
    assert "role" not in claims  # a plain user: the operations page refuses them


def test_cli_prints_an_operator_token_for_the_operations_page(tmp_path):
    cli = [sys.executable, "-m", "localmesh.dev_jwt", "--user", "olga", "--dir", str(tmp_path)]
    out = subprocess.run([*cli, "--role", "operator"], capture_output=True, text=True, check=True)
    claims = jwt.decode(out.stdout.strip(), options={"verify_signature": False})
    assert (claims["sub"], claims["role"]) == ("olga", "operator")
    wrong = subprocess.run([*cli, "--role", "admin"], capture_output=True, text=True, check=False)
    assert wrong.returncode == 2 and "invalid choice" in wrong.stderr


def test_a_token_for_nobody_is_refused(tmp_path):
    # Envoy would accept it but forward no identity, so every call would fail as unauthenticated.
    with pytest.raises(ValueError, match="needs a user"):
        ensure_keys(tmp_path).mint("", "pro")
    cli = subprocess.run(
        [sys.executable, "-m", "localmesh.dev_jwt", "--user", "", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert cli.returncode == 2 and "--user is empty" in cli.stderr


def test_make_token_without_a_login_name_speaks_for_alice(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("USER", "MAKEFLAGS", "MFLAGS")}
    out = subprocess.run(
        ["make", "-s", "token", "TIER=free"],
        cwd=REPO_ROOT,
        env={**env, DIR_ENV: str(tmp_path)},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    claims = jwt.decode(out, options={"verify_signature": False})
    assert (claims["sub"], claims["tier"]) == ("alice", "free")
