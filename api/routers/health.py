"""Probes and telemetry, none of them behind the API key: `/healthz` (answers from memory, so
it stays fast while every worker is busy; HEAD as every GET route, `api.head`), `/livez` (the process answers),
`/readyz` (the database takes a write and every worker dispatcher is alive; 503 otherwise),
`/version`, and Prometheus `/metrics`."""

from __future__ import annotations

import logging
import os
import platform

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, PlainTextResponse

from api.deps import JobsDep, RendersDep, StorageDep
from api.schemas import Health, Ready, Version

log = logging.getLogger(__name__)

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz(jobs: JobsDep) -> Health:
    return Health(status="ok", **jobs.stats())


@router.get("/livez", response_model=Health)
async def livez(jobs: JobsDep) -> Health:
    """The process is up and its event loop answers."""
    return Health(status="ok", **jobs.stats())


@router.get("/readyz", response_model=Ready, responses={503: {"model": Ready, "description": "not ready"}})
async def readyz(storage: StorageDep, jobs: JobsDep, renders: RendersDep) -> JSONResponse:
    """Ready to serve: the database takes a write transaction and the worker dispatchers live."""
    detail = None
    try:
        db = await run_in_threadpool(storage.writable)
    except Exception as exc:  # noqa: BLE001 - any failure means not ready, said in the detail
        # the probe is open to any client: the log has the database's path, the answer its name
        log.warning("readiness probe: database %s: %s: %s", storage.url, type(exc).__name__, exc)
        folder = os.path.dirname(storage.url)
        said = str(exc).replace(folder + os.sep, "") if folder else str(exc)
        db, detail = False, f"database: {type(exc).__name__}: {said}"
    workers = jobs.alive() and renders.alive()
    if not workers:
        detail = (detail + "; " if detail else "") + "a worker dispatcher is not running"
    ok = db and workers
    body = Ready(status="ready" if ok else "not ready", database=db, workers=workers, detail=detail)
    return JSONResponse(body.model_dump(), status_code=200 if ok else 503)


@router.get("/version", response_model=Version)
async def version(request: Request) -> Version:
    from api import service

    planner = service.planner_version()
    return Version(pipeplan=planner.split("+", 1)[0], planner=planner, api=request.app.version,
                   python=platform.python_version())


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
async def metrics(request: Request) -> PlainTextResponse:
    """Requests by route and status, latency histograms, solve times, queue depth."""
    return PlainTextResponse(request.app.state.metrics.render(),
                             media_type="text/plain; version=0.0.4; charset=utf-8")
