"""Who is calling, proven by a signed token: the one rule every service that serves users applies.

Envoy verifies the caller's JWT (``jwt_authn``) and forwards it (``authorization: Bearer``); the edge and
the orchestrator verify the same token again, against the same JWKS file, issuer and audience, with a
``TokenVerifier``. A service never trusts a user id it cannot verify: not in a request body, and not in
the ``x-chatmesh-user-id``/``x-chatmesh-tier`` headers either. Envoy still derives those two from the
verified claims for its own use (per-user rate limits, the access log); anyone who can reach a service
directly could forge them. The edge passes the caller's token on to the orchestrator, so one proof
travels the whole path. The keys are a JWKS file (dev keys, a Secret) or the identity provider's
``jwks_uri`` (chatmesh/remote_jwks.py, for sign-in through the provider: docs/deploy/sign-in.md).
The trust model, key sources and rotation: docs/architecture/overview.md#identity-and-trust.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import jwt

from chatmesh.remote_jwks import RemoteJwks
from chatmesh.tiers import DEFAULT_TIER, TIERS

log = logging.getLogger(__name__)

AUTHORIZATION_HEADER = "authorization"
# Set by Envoy from the verified claims for its rate limits and access log; services never trust them.
USER_ID_HEADER = "x-chatmesh-user-id"
TIER_HEADER = "x-chatmesh-tier"
# The one role a token's ``role`` claim may grant: the operations page is for it alone.
OPERATOR_ROLE = "operator"
# Every header Envoy derives from a verified token (and strips from what clients send).
IDENTITY_HEADERS = (USER_ID_HEADER, TIER_HEADER)
# Not identity but routing: the chat a call concerns. Envoy's ring hash keeps one chat on one orchestrator
# replica; the edge sets it for chat-scoped calls, gRPC clients may set it themselves. Never trusted.
CHAT_ID_HEADER = "x-chatmesh-chat-id"
# The audience of every token meant for chatmesh; Envoy and the services refuse tokens minted for anything else.
JWT_AUDIENCE = "chatmesh"
# Envoy's jwt_authn allows the same skew.
CLOCK_SKEW_S = 30
# A changed JWKS file (a rotated Kubernetes Secret) is picked up this soon, without a restart.
JWKS_RECHECK_S = 1.0
# Tokens verified lately, kept until they expire: a client sends the same token with every call for its
# lifetime, and checking its RS256 signature costs ~100 µs of CPU each time (Envoy's jwt_authn keeps
# such a cache too). An entry is the token (~0.7 KB) and its identity: ~8 MB when full.
VERIFIED_TOKENS = 10_000


@dataclass(frozen=True)
class Identity:
    user_id: str
    tier: str
    # The verified token's ``role`` claim when it is one chatmesh knows (OPERATOR_ROLE), else "".
    role: str = ""


@dataclass(frozen=True)
class IdentityConfig:
    """Where a service finds the keys that prove who calls it (the same JWKS and issuer as Envoy's).

    Flags of every service that serves users (``--jwks-file``, ``--jwt-issuer``, ``--jwt-audience``); plain
    metadata because contracts cannot import meshkit.
    """

    jwks_file: str = field(
        default="",
        metadata={
            "help": "JWKS file to verify callers' tokens with (Envoy's); this or --jwks-url is required"
        },
    )
    jwks_url: str = field(
        default="",
        metadata={
            "help": "the identity provider's jwks_uri to verify callers' tokens with, fetched and cached "
            "(sign-in through the provider; instead of --jwks-file)"
        },
    )
    jwt_issuer: str = field(default="chatmesh-dev", metadata={"help": "issuer callers' tokens must carry"})
    jwt_audience: str = field(default=JWT_AUDIENCE, metadata={"help": "audience callers' tokens must carry"})


class Unauthenticated(Exception):
    """No verifiable identity; the message is safe to show the caller."""


class TokenVerifier:
    """Verifies bearer tokens against a JWKS file, re-read when it changes (key rotation), or against an
    identity provider's published keys (``remote``), and remembers the tokens it verified. Not
    thread-safe: each service verifies on its event loop's thread."""

    def __init__(
        self,
        jwks_file: Path | None,
        issuer: str,
        audience: str = JWT_AUDIENCE,
        remote: RemoteJwks | None = None,
    ) -> None:
        self.jwks_file, self.issuer, self.audience, self._remote = jwks_file, issuer, audience, remote
        self._stamp = self._file_stamp() if jwks_file else (0, 0, 0)
        self._keys = self._read_keys() if jwks_file else []
        self._checked_at = time.monotonic()
        self._generation = remote.generation if remote else 0
        # Token -> its identity and until when (epoch seconds) it stays valid; least recently used first.
        self._verified: OrderedDict[str, tuple[Identity, float]] = OrderedDict()

    @classmethod
    def from_config(cls, config: IdentityConfig) -> TokenVerifier:
        """A verifier for ``config``; ValueError (a usage error) when the JWKS is missing or unusable."""
        if config.jwks_url and config.jwks_file:
            raise ValueError("--jwks-file and --jwks-url are exclusive: verify with one source of keys")
        if config.jwks_url:
            if not config.jwks_url.startswith(("https://", "http://")):
                raise ValueError(f"--jwks-url {config.jwks_url!r} is not an http(s) URL")
            return cls(None, config.jwt_issuer, config.jwt_audience, remote=RemoteJwks(config.jwks_url))
        if not config.jwks_file:
            raise ValueError(
                "--jwks-file is required: the JWKS Envoy verifies tokens with "
                "(`make run` passes the dev one; in Kubernetes the chart mounts Envoy's Secret), "
                "or --jwks-url: your identity provider's jwks_uri"
            )
        try:
            return cls(Path(config.jwks_file), config.jwt_issuer, config.jwt_audience)
        except (OSError, ValueError, jwt.PyJWKSetError) as exc:
            raise ValueError(f"--jwks-file {config.jwks_file}: {exc}") from exc

    def identity(self, authorization: str | None) -> Identity:
        """The identity an ``Authorization: Bearer <JWT>`` value proves; Unauthenticated if none."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("no bearer token: call through Envoy with `authorization: Bearer <JWT>`")
        # Checked first on every call, hit or not: a key removed from the JWKS revokes its tokens here.
        keys = self._current_keys(None if token in self._verified else _kid_of(token))
        known = self._verified.get(token)
        if known is not None and time.time() < known[1]:
            self._verified.move_to_end(token)
            return known[0]
        self._verified.pop(token, None)
        identity, valid_until = self._verify(token, keys)
        self._verified[token] = (identity, valid_until)
        if len(self._verified) > VERIFIED_TOKENS:
            self._verified.popitem(last=False)
        return identity

    def _verify(self, token: str, keys: list[jwt.PyJWK]) -> tuple[Identity, float]:
        """The identity the token proves and until when it is valid (its ``exp`` with the skew allowed)."""
        try:
            claims = self._claims(token, keys)
        except jwt.ExpiredSignatureError as exc:
            raise Unauthenticated("the bearer token has expired") from exc
        except (jwt.PyJWTError, ValueError) as exc:
            log.info("refused a bearer token: %s", exc)
            raise Unauthenticated("the bearer token is not valid for chatmesh") from exc
        user_id, tier = claims.get("sub"), claims.get("tier")
        if not isinstance(user_id, str) or not user_id.strip():
            raise Unauthenticated("the bearer token names no user (sub)")
        tier = tier.strip().lower() if isinstance(tier, str) else DEFAULT_TIER
        role = claims.get("role")
        role = role.strip().lower() if isinstance(role, str) else ""
        # An unknown tier is treated as the default (lowest) tier rather than trusted; an unknown role as none.
        identity = Identity(
            user_id=user_id.strip(),
            tier=tier if tier in TIERS else DEFAULT_TIER,
            role=role if role == OPERATOR_ROLE else "",
        )
        # jwt.decode required and checked a numeric ``exp``.
        return identity, float(claims["exp"]) + CLOCK_SKEW_S

    def identity_from_metadata(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Identity:
        """The identity proven by the ``authorization`` entry of gRPC metadata (or HTTP headers)."""
        for key, value in metadata or ():
            if key.lower() == AUTHORIZATION_HEADER and isinstance(value, str):
                return self.identity(value)
        return self.identity(None)

    def _claims(self, token: str, keys: list[jwt.PyJWK]) -> dict:
        kid = jwt.get_unverified_header(token).get("kid")
        candidates = [key for key in keys if key.key_id == kid] if kid else keys
        if not candidates:
            raise ValueError(f"no key {kid!r} in {self._remote.url if self._remote else self.jwks_file}")
        error: Exception = ValueError("no key verified the token")
        for key in candidates:
            try:
                # The key's own algorithm only: a token cannot pick a weaker one (or "none").
                return jwt.decode(
                    token,
                    key.key,
                    algorithms=[key.algorithm_name],
                    audience=self.audience,
                    issuer=self.issuer,
                    leeway=CLOCK_SKEW_S,
                    options={"require": ["exp", "iss", "aud", "sub"]},
                )
            except jwt.InvalidSignatureError as exc:
                error = exc
        raise error

    def _current_keys(self, kid: str | None) -> list[jwt.PyJWK]:
        """The keys to verify with; ``kid``: the key a token not yet verified names, which a remote
        set lacking it is fetched again for (a rotation at the provider)."""
        if self._remote is not None:
            keys = self._remote.keys(kid)
            if self._remote.generation != self._generation:
                self._generation = self._remote.generation
                # A token verified with a key the new set lacks must not outlive that key.
                self._verified.clear()
            return keys
        assert self.jwks_file is not None
        now = time.monotonic()
        if now - self._checked_at >= JWKS_RECHECK_S:
            self._checked_at = now
            try:
                stamp = self._file_stamp()
                if stamp != self._stamp:
                    self._keys, self._stamp = self._read_keys(), stamp
                    # A token verified with a key the new set lacks must not outlive that key.
                    self._verified.clear()
                    log.info("reloaded %d verification keys from %s", len(self._keys), self.jwks_file)
            except (OSError, ValueError, jwt.PyJWKSetError) as exc:
                # Mid-rotation a file can be briefly missing or half-written: keep the keys that worked.
                log.warning("kept the previous keys: %s is unusable: %s", self.jwks_file, exc)
        return self._keys

    def _read_keys(self) -> list[jwt.PyJWK]:
        assert self.jwks_file is not None
        return list(jwt.PyJWKSet.from_dict(json.loads(self.jwks_file.read_text())).keys)

    def _file_stamp(self) -> tuple[int, int, int]:
        assert self.jwks_file is not None
        # Kubernetes swaps a Secret volume's files by symlink: stat follows it to the new file.
        stat = os.stat(self.jwks_file)
        return (stat.st_ino, stat.st_mtime_ns, stat.st_size)


def _kid_of(token: str) -> str | None:
    """The key id a token's header names; None when it names none (or is no JWT: verifying says so)."""
    try:
        kid = jwt.get_unverified_header(token).get("kid")
    except jwt.PyJWTError:
        return None
    return kid if isinstance(kid, str) else None
