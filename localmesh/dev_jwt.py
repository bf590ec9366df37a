"""Dev JWTs: an RS256 key pair and its JWKS, made on first use, and a CLI that prints a signed token.

``make token USER=alice TIER=pro`` (``python -m localmesh.dev_jwt --user alice --tier pro``) prints a token
that the local Envoy, edge and orchestrator accept (``DevKeys.service_flags`` points the services at the
same JWKS); ``ROLE=operator`` (``--role operator``) adds the role claim that opens the operations page
(``/ops``). The key pair lives in a gitignored directory (``.cache/dev-jwt/`` by default,
``CHATMESH_DEV_JWT_DIR`` to move it) and is never committed. In production Envoy and the services verify
tokens from your identity provider's JWKS instead; nothing else changes.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

from chatmesh.identity import JWT_AUDIENCE, OPERATOR_ROLE
from chatmesh.tiers import TIERS

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = REPO_ROOT / ".cache" / "dev-jwt"
DIR_ENV = "CHATMESH_DEV_JWT_DIR"
ISSUER = "chatmesh-dev"
DEFAULT_TTL_S = 12 * 3600


@dataclass(frozen=True)
class DevKeys:
    """An RS256 signing key and the JWKS file that Envoy verifies it with."""

    private_key_path: Path
    jwks_path: Path
    kid: str

    def service_flags(self) -> list[str]:
        """The edge's and orchestrator's flags to verify these keys' tokens (chatmesh.identity.IdentityConfig)."""
        return ["--jwks-file", str(self.jwks_path), "--jwt-issuer", ISSUER]

    def mint(
        self,
        user: str,
        tier: str = "free",
        ttl_s: float = DEFAULT_TTL_S,
        now: float | None = None,
        issuer: str = ISSUER,
        audience: str = JWT_AUDIENCE,
        role: str = "",
    ) -> str:
        """A signed token for ``user`` (the ``sub`` claim) with ``tier`` and, if given, ``role``; a negative
        ttl makes an expired one."""
        if not user:
            # Envoy would accept it and forward no identity: every call would then fail as unauthenticated.
            raise ValueError("a token needs a user (the sub claim)")
        issued = int(now if now is not None else time.time())
        claims = {
            "iss": issuer,
            "aud": audience,
            "sub": user,
            "tier": tier,
            "iat": issued,
            "exp": issued + int(ttl_s),
        }
        if role:
            claims["role"] = role
        key = _signing_key(self.private_key_path.read_bytes())
        return jwt.encode(claims, key, algorithm="RS256", headers={"kid": self.kid})


@functools.lru_cache(maxsize=8)
def _signing_key(pem: bytes) -> rsa.RSAPrivateKey:
    """The parsed key, kept: parsing checks the RSA key and costs ~35 ms, signing ~1 ms (keyed by the
    file's bytes, so a key written anew at the same path is parsed anew)."""
    key = serialization.load_pem_private_key(pem, password=None)
    assert isinstance(key, rsa.RSAPrivateKey), "the dev key pair is RSA"
    return key


def generate_keys(directory: Path) -> DevKeys:
    """A fresh key pair written to ``directory`` (private key readable by the owner only)."""
    directory.mkdir(parents=True, exist_ok=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public_der = key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    digest = hashes.Hash(hashes.SHA256())
    digest.update(public_der)
    kid = digest.finalize().hex()[:16]
    jwk = RSAAlgorithm.to_jwk(key.public_key(), as_dict=True)
    jwk.update({"kid": kid, "alg": "RS256", "use": "sig"})
    private_path, jwks_path = directory / "private_key.pem", directory / "jwks.json"
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    # Write to temporary names and rename, so a concurrent reader never sees half a key.
    tmp_private, tmp_jwks = private_path.with_suffix(".tmp"), jwks_path.with_suffix(".tmp")
    fd = os.open(tmp_private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    tmp_jwks.write_text(json.dumps({"keys": [jwk]}, indent=2))
    os.replace(tmp_jwks, jwks_path)
    os.replace(tmp_private, private_path)
    return DevKeys(private_key_path=private_path, jwks_path=jwks_path, kid=kid)


def ensure_keys(directory: Path | None = None) -> DevKeys:
    """The dev key pair in ``directory``, generated on first use."""
    directory = Path(directory or os.environ.get(DIR_ENV) or DEFAULT_DIR)
    private_path, jwks_path = directory / "private_key.pem", directory / "jwks.json"
    if not (private_path.exists() and jwks_path.exists()):
        return generate_keys(directory)
    kid = json.loads(jwks_path.read_text())["keys"][0]["kid"]
    return DevKeys(private_key_path=private_path, jwks_path=jwks_path, kid=kid)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m localmesh.dev_jwt", description="Print a signed dev JWT that the local Envoy accepts."
    )
    parser.add_argument("--user", default="alice", help="the sub claim: who the token speaks for")
    parser.add_argument("--tier", default="pro", choices=TIERS, help="the tier claim")
    parser.add_argument(
        "--role", default="", choices=("", OPERATOR_ROLE), help="the role claim (operator: the /ops page)"
    )
    parser.add_argument("--ttl-s", type=float, default=DEFAULT_TTL_S, help="seconds until the token expires")
    parser.add_argument("--dir", type=Path, default=None, help=f"key directory [env {DIR_ENV}]")
    args = parser.parse_args(argv)
    if not args.user.strip():
        parser.error("--user is empty: name who the token speaks for (make token USER=alice)")
    keys = ensure_keys(args.dir)
    print(keys.mint(args.user, args.tier, args.ttl_s, role=args.role))
    return 0


if __name__ == "__main__":
    sys.exit(main())
