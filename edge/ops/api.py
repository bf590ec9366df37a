"""The operations page's routes: ``/ops`` (the page itself: static, no data) and its JSON under
``/v1/ops/`` (behind Envoy's JWT check like every ``/v1/`` route), for callers whose token carries
``role: operator`` (verified by the edge like every caller's token); anyone else gets 403."""

from __future__ import annotations

import asyncio
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from chatmesh.identity import OPERATOR_ROLE
from edge.chats_api import caller_of, path_id
from edge.errors import ApiError
from edge.ops.overview import overview
from edge.ops.scrape import Scraper
from edge.ops.settings import OpsSettings
from edge.ops.traces import find_run_trace
from edge.pages import page


def require_operator(request: Request) -> None:
    caller = caller_of(request)  # 401 without a verified identity
    if caller.identity.role != OPERATOR_ROLE:
        raise ApiError(
            403,
            f"the operations page is for the {OPERATOR_ROLE} role and {caller.identity.user_id}'s token "
            f"has none; sign in with an operator token (make token ROLE={OPERATOR_ROLE})",
            type="permission_error",
            code="permission_denied",
        )


async def ops_page(_: Request) -> FileResponse:
    return page("ops.html")


async def ops_overview(request: Request) -> JSONResponse:
    require_operator(request)
    scraper: Scraper = request.app.state.ops_scraper
    targets = {target.name: target.url for target in scraper.settings.metrics_targets}
    return JSONResponse(overview(list(scraper.rounds), targets))


async def run_trace(request: Request) -> JSONResponse:
    require_operator(request)
    run_id = path_id(request, "run_id", "run")
    settings: OpsSettings = request.app.state.ops_scraper.settings
    if not settings.trace_file:
        raise ApiError(
            501,
            "this edge has no span file to look traces up in (--ops-trace-file); use your tracing backend",
            type="server_error",
            code="not_configured",
        )
    trace = await asyncio.to_thread(find_run_trace, Path(settings.trace_file), run_id)
    if trace is None:
        raise ApiError(
            404, f"no trace of run {run_id!r} (yet): spans arrive when each hop ends", type="not_found_error"
        )
    return JSONResponse({"run_id": run_id, "trace_id": trace.trace_id, "spans": trace.spans})


routes = [
    Route("/ops", ops_page, methods=["GET"]),
    Route("/v1/ops/overview", ops_overview, methods=["GET"]),
    Route("/v1/ops/runs/{run_id}/trace", run_trace, methods=["GET"]),
]
