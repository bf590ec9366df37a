"""The edge's ASGI application: REST + SSE for browsers and the OpenAI-compatible API."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


async def healthz(_: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


def create_app() -> Starlette:
    return Starlette(routes=[Route("/healthz", healthz)])
