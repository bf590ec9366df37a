"""The edge's ASGI application: REST + SSE for the chat page, the OpenAI-compatible API, the page itself.

Stateless: every API call becomes one ChatService call (``app.state.orchestrator``); the page is static
files. Errors leave as OpenAI-shaped JSON with the matching status (see edge/errors.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route

from chatmesh.identity import TokenVerifier
from edge import chats_api, completions_api, conversations_api, embeddings_api, openai_api, responses_api
from edge.chat_client.client import ChatClient
from edge.client_gone import ClientGone, client_gone
from edge.drain import Drain
from edge.errors import ApiError
from edge.observability import ObservabilityMiddleware
from edge.ops import api as ops_api
from edge.ops.scrape import Scraper
from edge.pages import STATIC_DIR, PageFiles, page
from edge.settings import EdgeSettings

log = logging.getLogger(__name__)


async def healthz(request: Request) -> JSONResponse:
    # Draining: tell load balancers (Envoy's health checks) to stop sending new work here.
    if request.app.state.drain.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def index(_: Request) -> FileResponse:
    return page("index.html")


async def api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return exc.response()


async def http_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(
        exc.status_code, "invalid_request_error"
    )
    return ApiError(exc.status_code, str(exc.detail), type=kind).response()


async def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return ApiError(
        500, "internal error in the edge; retry, and report it if it persists", type="server_error"
    ).response()


def create_app(settings: EdgeSettings, verifier: TokenVerifier, drain: Drain | None = None) -> Starlette:

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # The gRPC channel belongs to the server's event loop, so it is made here.
        app.state.orchestrator = ChatClient(
            settings.orchestrator,
            links=settings.completion_links,
            unary_timeout_s=settings.unary_timeout_s,
            stream_timeout_s=settings.stream_timeout_s,
            start_timeout_s=settings.completion_start_timeout_s,
            drain=app.state.drain,
        )
        await app.state.orchestrator.start()
        scraping = asyncio.create_task(app.state.ops_scraper.run())
        try:
            yield
        finally:
            scraping.cancel()
            await app.state.orchestrator.close()

    app = Starlette(
        routes=[
            Route("/healthz", healthz, methods=["GET"]),
            *chats_api.routes,
            *openai_api.routes,
            *completions_api.routes,
            *embeddings_api.routes,
            *responses_api.routes,
            *conversations_api.routes,
            *ops_api.routes,
            Route("/", index, methods=["GET"]),
            Mount("/static", PageFiles(directory=STATIC_DIR), name="static"),
        ],
        middleware=[Middleware(ObservabilityMiddleware)],
        exception_handlers={
            ApiError: api_error,
            HTTPException: http_error,
            ClientGone: client_gone,
            Exception: unexpected_error,
        },
        lifespan=lifespan,
    )
    app.state.settings = settings
    app.state.ops_scraper = Scraper(settings.ops)
    app.state.verifier = verifier
    app.state.drain = drain or Drain()
    return app
