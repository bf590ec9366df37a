"""How the edge serves its pages and their static files: with a strict Content-Security-Policy.

Answers are model output, which is untrusted input rendered as HTML (edge/static/render.js sanitizes
it); the policy is the second wall. Scripts, styles, images and connections come only from this origin,
nothing may frame the page, and there are no plugins or <base> tricks, so a fragment that slipped past
the sanitizer can neither run nor fetch anything (a remote image is a known way to leak a chat). Every
static file gets the headers too: /static/index.html is the same page as / and must not escape them.
"""

from __future__ import annotations

from pathlib import Path

from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"

CONTENT_SECURITY_POLICY = "; ".join(
    [
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "font-src 'self'",
        "manifest-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    ]
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",  # frame-ancestors for browsers that predate it
}


def page(name: str) -> FileResponse:
    """One of the static pages (index.html, ops.html), always revalidated, with the security headers."""
    return FileResponse(STATIC_DIR / name, headers={"Cache-Control": "no-cache", **SECURITY_HEADERS})


class PageFiles(StaticFiles):
    """/static/: the page's scripts, styles and vendored libraries, each with the security headers."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response
