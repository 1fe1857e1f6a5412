"""The FastAPI application: `create_app(settings)` wires storage, the job queue, the body size
limit, the optional API key and the routers. Served by `python -m planner serve`."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from api.deps import require_api_key
from api.jobs import JobManager
from api.limits import BodySizeLimit
from api.routers import health, jobs, plans, profiles
from api.settings import Settings
from api.storage import Storage
from planner.errors import PipeplanError

log = logging.getLogger(__name__)

LOST = "the server stopped before this job finished; send the request again"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage = Storage(settings.db)
        lost = storage.fail_unfinished_jobs(LOST)
        if lost:
            log.warning("%d job(s) left unfinished by the previous server marked failed", lost)
        manager = JobManager(storage, settings.workers, settings.queue_size)
        manager.start()
        app.state.storage, app.state.jobs = storage, manager
        try:
            yield
        finally:
            manager.stop()
            storage.close()

    keyed = settings.api_key is not None
    app = FastAPI(
        title="pipeplan",
        version="0.1.0",
        description="Pipeline-parallel training plans as a service: store profiles, plan them on "
                    "a cluster, look at past plans and their timelines.",
        lifespan=lifespan,
        # with an API key, the schema and the docs are behind it too (every route but /healthz)
        openapi_url=None if keyed else "/openapi.json",
        docs_url=None if keyed else "/docs",
        redoc_url=None,
    )
    app.state.settings = settings
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        """422 with the field and the reason; the offending value only when it is a short scalar
        (a whole profile echoed back would double the traffic)."""
        detail = []
        for err in exc.errors():
            item = {"loc": list(err.get("loc", ())), "msg": err.get("msg", ""), "type": err.get("type", "")}
            value = err.get("input")
            if value is None or isinstance(value, bool | int | float) or (
                    isinstance(value, str) and len(value) <= 200):
                item["input"] = value
            if err.get("ctx"):
                item["ctx"] = {k: v if isinstance(v, bool | int | float | str) else str(v)
                               for k, v in err["ctx"].items()}
            detail.append(item)
        return JSONResponse({"detail": jsonable_encoder(detail)}, status_code=422)

    @app.exception_handler(PipeplanError)
    async def _user_error(request: Request, exc: PipeplanError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=422)

    app.include_router(health.router)
    secured = [Depends(require_api_key)]
    for module in (profiles, plans, jobs):
        app.include_router(module.router, dependencies=secured)
    if keyed:
        @app.get("/openapi.json", include_in_schema=False, dependencies=secured)
        async def _openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

        @app.get("/docs", include_in_schema=False, dependencies=secured)
        async def _docs() -> HTMLResponse:
            return get_swagger_ui_html(openapi_url="/openapi.json", title="pipeplan")
    return app
