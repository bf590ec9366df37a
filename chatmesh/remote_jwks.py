"""An identity provider's signing keys, read from its ``jwks_uri`` over HTTP: cached, and fetched again when
they age or when a token names a key the cache lacks (the provider rotated), at most so often.

The services verify sign-in tokens (docs/deploy/sign-in.md) with these keys as Envoy does with its own
copy (``remote_jwks``); a JWKS file (``--jwks-file``) stays the way for dev and self-minted keys.
"""

from __future__ import annotations

import json
import logging
import math
import time
import urllib.request

import jwt

log = logging.getLogger(__name__)

# Keys are fetched again this long after they were fetched, so a key the provider withdrew stops being
# trusted within it (Envoy's remote_jwks cache lasts as long).
JWKS_MAX_AGE_S = 300.0
# A token naming an unknown key fetches the set again (a rotation), but not more often than this: random
# key ids cannot turn callers into a flood on the provider, or stall a service's event loop.
JWKS_MIN_REFETCH_S = 10.0
FETCH_TIMEOUT_S = 3.0


class RemoteJwks:
    """The keys at ``url``; not thread-safe (each service verifies on its event loop's thread).

    A fetch is a blocking HTTP GET of at most FETCH_TIMEOUT_S, done on the caller's thread: Envoy has
    verified the token first, so a fetch for an unknown key happens only when the provider rotated, and
    an aged set is fetched once per JWKS_MAX_AGE_S."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._keys: list[jwt.PyJWK] = []
        self._fetched_at = -math.inf
        self._tried_at = -math.inf
        # Bumped whenever the set of key ids changes, so a verifier forgets tokens a gone key proved.
        self.generation = 0
        # Best effort: a provider down at start is tried again on the first token.
        self._fetch()

    def keys(self, kid: str | None) -> list[jwt.PyJWK]:
        """The current keys, fetched again first if they aged or lack ``kid`` (and a fetch is allowed)."""
        now = time.monotonic()
        aged = now - self._fetched_at >= JWKS_MAX_AGE_S
        missing = kid is not None and all(key.key_id != kid for key in self._keys)
        if (aged or missing) and now - self._tried_at >= JWKS_MIN_REFETCH_S:
            self._fetch()
        return self._keys

    def _fetch(self) -> None:
        self._tried_at = time.monotonic()
        request = urllib.request.Request(self.url, headers={"accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=FETCH_TIMEOUT_S) as response:
                keys = list(jwt.PyJWKSet.from_dict(json.load(response)).keys)
        except (OSError, ValueError, jwt.PyJWKSetError) as exc:
            # The keys that worked stay: a provider briefly down must not sign everyone out.
            log.warning("kept %d verification keys: fetching %s failed: %s", len(self._keys), self.url, exc)
            return
        if {key.key_id for key in keys} != {key.key_id for key in self._keys}:
            self.generation += 1
            log.info("fetched %d verification keys from %s", len(keys), self.url)
        self._keys, self._fetched_at = keys, self._tried_at
