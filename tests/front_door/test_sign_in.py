"""Sign-in through a real OpenID Connect provider (panva's oidc-provider under Node, started here) in
headless Chromium, through the real Envoy (its OAuth2 filter: code flow with PKCE, refresh, sign-out) and
the real edge, with ScriptedChatService verifying callers against the provider's published keys as the
orchestrator would. Tokens the provider did not issue for chatmesh are refused with 401s in the OpenAI
error shape, by Envoy and by the edge on its own."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa

from chatmesh.identity import CLOCK_SKEW_S, JWT_AUDIENCE, IdentityConfig, TokenVerifier
from localmesh.dev_jwt import DevKeys
from meshkit.launcher import Launcher, free_port
from tests.fixtures.edge import EdgeHandle, start_edge
from tests.fixtures.envoy import EnvoyHandle, envoy_config_for, start_envoy
from tests.fixtures.oidc_provider import OidcProvider, start_oidc_provider
from tests.front_door.chat_page import LIVE
from tests.front_door.scripted_chat_service import ScriptedChatServer, ScriptedChatService

# Short, so a test can see Envoy refresh an expired access token.
ACCESS_TOKEN_TTL_S = 4


@dataclass
class SignInDoor:
    idp: OidcProvider
    envoy: EnvoyHandle
    edge: EdgeHandle
    scripted: ScriptedChatService

    @property
    def url(self) -> str:
        return self.envoy.url


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory, dev_jwt_keys: DevKeys) -> Iterator[SignInDoor]:
    run_dir = tmp_path_factory.mktemp("sign-in")
    listen_port = free_port()
    url = f"http://127.0.0.1:{listen_port}"
    with Launcher(run_dir, echo=lambda line: None) as launcher:
        idp = start_oidc_provider(
            launcher,
            redirect_uri=f"{url}/oauth2/callback",
            post_logout_redirect_uri=f"{url}/",
            audience=JWT_AUDIENCE,
            access_token_ttl_s=ACCESS_TOKEN_TTL_S,
        )
        identity = IdentityConfig(jwks_url=idp.discovery["jwks_uri"], jwt_issuer=idp.issuer)
        server = ScriptedChatServer(TokenVerifier.from_config(identity)).start()
        try:
            edge_port = free_port()
            edge = start_edge(
                launcher,
                f"127.0.0.1:{server.port}",
                port=edge_port,
                identity_flags=("--jwks-url", identity.jwks_url, "--jwt-issuer", identity.jwt_issuer),
            )
            config = envoy_config_for(dev_jwt_keys, edge_port=edge_port, orchestrator_ports=[server.port])
            config = replace(
                config,
                listen_port=listen_port,
                cors_origins=(url,),
                jwks_path=None,
                jwt_issuer=idp.issuer,
                sign_in=idp.sign_in(f"{url}/oauth2/callback", run_dir / "secrets"),
            )
            envoy = start_envoy(launcher, config, dev_jwt_keys)
            yield SignInDoor(idp, envoy, edge, server.service)
        finally:
            server.stop()


def sign_in(page, door: SignInDoor, user: str) -> None:
    """Opens the chat page, which sends the browser to the provider's login form; signs in as ``user``."""
    # Signed out everywhere first (the module's tests share one browser profile).
    page.context.clear_cookies()
    page.goto(door.url)
    assert page.url.startswith(door.idp.issuer), f"not sent to the provider to sign in: {page.url}"
    page.fill("input[name=login]", user)
    page.fill("input[name=password]", "any password")
    page.click("button[type=submit]")
    page.wait_for_selector(f"#whoami:has-text('Signed in as {user}')")
    assert page.url.startswith(door.url)


def bearer_of(call) -> str:
    """The access token a call to the chat service carried (Envoy put it there, the edge passed it on)."""
    return call.metadata["authorization"].split()[1]


def page_fetch_status(page, path: str) -> int:
    """The status of a call the page makes itself (same origin, its cookies)."""
    return page.evaluate("async (path) => (await fetch(path)).status", path)


def test_a_user_signs_in_chats_as_themself_and_the_page_holds_no_token(browser_context, door: SignInDoor):
    page = browser_context.new_page()
    page.set_default_timeout(15_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    sign_in(page, door, "oidc-alice")
    # The code was exchanged with its PKCE verifier (the provider requires one of every client).
    grants = door.idp.events("grant")
    assert grants and grants[-1]["grant_type"] == "authorization_code"
    assert door.idp.events("grant_error") == []
    # An answer streams: the chat service saw the provider's token, naming this user.
    sends = len(door.scripted.calls_to("SendMessage"))
    page.fill("#prompt", "hello !tokens 3 10")
    page.press("#prompt", "Enter")
    page.wait_for_selector(LIVE)
    page.wait_for_selector("#live", state="detached")
    access_token = bearer_of(door.scripted.calls_to("SendMessage")[sends])
    claims = jwt.decode(access_token, options={"verify_signature": False})
    assert (claims["sub"], claims["iss"], claims["aud"]) == ("oidc-alice", door.idp.issuer, JWT_AUDIENCE)
    # The token lives in Envoy's HttpOnly cookies only: nothing a script (or injected markup) could read.
    held = page.evaluate(
        "() => [document.cookie, JSON.stringify(localStorage), JSON.stringify(sessionStorage)]"
    )
    assert all(access_token not in value for value in held), held
    assert all(c["httpOnly"] for c in page.context.cookies() if c["name"] in ("BearerToken", "RefreshToken"))
    assert errors == []
    page.close()


def test_an_expired_access_token_is_refreshed_without_the_user_noticing(browser_context, door: SignInDoor):
    page = browser_context.new_page()
    page.set_default_timeout(15_000)
    sign_in(page, door, "oidc-bob")
    before = bearer_of(door.scripted.calls_to("ListChats")[-1])
    refreshes = len([g for g in door.idp.events("grant") if g["grant_type"] == "refresh_token"])
    # The provider's access tokens live ACCESS_TOKEN_TTL_S; Envoy's session says when this one ends.
    time.sleep(ACCESS_TOKEN_TTL_S + 1)
    assert page_fetch_status(page, "/v1/chats") == 200
    assert len([g for g in door.idp.events("grant") if g["grant_type"] == "refresh_token"]) == refreshes + 1
    after = bearer_of(door.scripted.calls_to("ListChats")[-1])
    old, new = (jwt.decode(t, options={"verify_signature": False}) for t in (before, after))
    assert new["sub"] == old["sub"] == "oidc-bob" and new["exp"] > old["exp"]
    page.reload()
    page.wait_for_selector("#whoami:has-text('Signed in as oidc-bob')")
    page.close()


def test_sign_out_ends_the_session_here_and_at_the_provider(browser_context, door: SignInDoor):
    page = browser_context.new_page()
    page.set_default_timeout(15_000)
    sign_in(page, door, "oidc-carol")
    page.click("#sign-out")
    # Envoy clears its cookies and sends the browser to the provider to end its session too (RP-initiated
    # logout), which asks to confirm and sends the browser back to the page, which asks to sign in again.
    page.wait_for_url(f"{door.idp.issuer}/session/end**")
    page.click("button[autofocus]")
    page.wait_for_selector("input[name=login]")
    assert page.url.startswith(door.idp.issuer)
    assert len(door.idp.events("end_session")) == 1
    assert not any(c["name"] in ("BearerToken", "RefreshToken") for c in page.context.cookies())
    # The page's API calls are refused now (Envoy answers 401 to them rather than redirecting).
    assert page.request.get(f"{door.url}/v1/me").status == 401
    page.close()


def test_tokens_the_provider_did_not_issue_for_chatmesh_are_refused(door: SignInDoor):
    now = int(time.time())
    claims = {"iss": door.idp.issuer, "aud": JWT_AUDIENCE, "sub": "mallory", "iat": now, "exp": now + 300}
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    good = door.idp.mint(claims)
    refused = {
        "another issuer": door.idp.mint({**claims, "iss": "https://idp.example.com"}),
        "expired": door.idp.mint({**claims, "exp": now - CLOCK_SKEW_S - 60, "iat": now - 3600}),
        "another audience": door.idp.mint({**claims, "aud": "billing"}),
        # The provider's key id, another key's signature.
        "a forged signature": door.idp.mint(claims, key=stranger),
    }
    body = {"model": "default", "messages": [{"role": "user", "content": "hi"}]}
    for base in (door.url, door.edge.url):  # through Envoy, and straight to the edge
        assert (
            httpx.get(f"{base}/v1/me", headers={"authorization": f"Bearer {good}"}).json()["user_id"]
            == "mallory"
        )
        for why, token in refused.items():
            reply = httpx.post(
                f"{base}/v1/chat/completions", json=body, headers={"authorization": f"Bearer {token}"}
            )
            # Envoy's jwt_authn answers a token for another audience 403 (authentic, but not for us).
            expected = 403 if (base, why) == (door.url, "another audience") else 401
            assert reply.status_code == expected, (base, why, reply.text)
            error = reply.json()["error"]
            assert isinstance(error["message"], str) and error["message"] and "type" in error, (
                base,
                why,
                error,
            )
