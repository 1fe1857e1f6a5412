"""The FastAPI application: `create_app(settings)` wires storage, the job queue, the render pool,
retention, the middleware (request id, metrics and access log; gzip; CORS; body size limit), one
JSON error shape for every 4xx/5xx, the client check (API keys, quotas) and the routers. Served
by `python -m planner serve`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Route

from api import docs, openapi, service
from api.body import value_limits
from api.deps import RateLimiter, before_body, key_is_valid, open_client, require_client
from api.head import HeadAsGet
from api.jobs import JobManager
from api.limits import BodySizeLimit
from api.observe import Metrics, RequestContext, request_id
from api.pool import RenderPool
from api.routers import health, jobs, plans, profiles
from api.schemas import CompareRequest, PlanRequest
from api.settings import Settings
from api.storage import Storage, lock_database
from api.wording import in_api_words
from planner.errors import PipeplanError
from planner.formats import Profile

log = logging.getLogger(__name__)

LOST = "the server stopped before this job finished; send the request again"
API_VERSION = "1.1.0"


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, bool | int | str) or (
        isinstance(value, float) and value == value and abs(value) != float("inf"))


def error_response(request: Request, status: int, detail: Any,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """The one error shape: {"detail": ..., "request_id": ...}."""
    rid = request_id(request.scope)
    out = dict(headers or {})
    if rid:
        out["X-Request-ID"] = rid
    return JSONResponse({"detail": detail, "request_id": rid}, status_code=status, headers=out)


def validation_detail(errors: Any) -> list[dict[str, Any]]:
    """422 items with the field and the reason; the offending value only when it is a short
    finite scalar (a whole profile echoed back would double the traffic; NaN is not JSON)."""
    detail = []
    for err in errors:
        item: dict[str, Any] = {"loc": [p if isinstance(p, int | str) else str(p) for p in err.get("loc", ())],
                                "msg": str(err.get("msg", "")), "type": str(err.get("type", ""))}
        value = err.get("input")
        if _scalar(value) and not (isinstance(value, str) and len(value) > 200):
            item["input"] = value
        if err.get("ctx"):
            item["ctx"] = {str(k): v if _scalar(v) else str(v) for k, v in err["ctx"].items()}
        detail.append(item)
    return detail


ROUTERS = (health, profiles, plans, jobs)


def _answers(app: FastAPI, path: str, method: str) -> bool:
    """Whether a `method` request to `path` reaches a route that serves it: the first route that
    takes it (the one dispatched to) does not refuse the method (`endpoint.refuses_method`:
    /v1/plans/compare's, ahead of /v1/plans/{plan_id}). The routers' own routes, then the app's
    (docs): FastAPI's app router holds each included router as one opaque route."""
    routes = [*(r for module in ROUTERS for r in module.router.routes), *app.router.routes]
    for route in routes:
        if (isinstance(route, Route) and route.methods and method in route.methods
                and route.path_regex.match(path)):
            return not getattr(route.endpoint, "refuses_method", False)
    return False


def allowed_methods(app: FastAPI, scope: dict[str, Any]) -> list[str]:
    """Every method some route accepts at this path (for 405's Allow header)."""
    path = scope["path"].removeprefix(scope.get("root_path", "") or "") or "/"
    methods = [m for m in ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT") if _answers(app, path, m)]
    if "GET" in methods and "HEAD" not in methods:  # api.head answers HEAD where GET is served
        methods.insert(methods.index("GET") + 1, "HEAD")
    return methods


CLIENT_CLOSED = 499


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 422, validation_detail(exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        headers = dict(exc.headers or {})
        route = request.scope.get("route")
        if exc.status_code == 405 and not getattr(getattr(route, "endpoint", None), "refuses_method", False):
            headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        return error_response(request, exc.status_code, exc.detail, headers)

    @app.exception_handler(PipeplanError)
    async def _user_error(request: Request, exc: PipeplanError) -> JSONResponse:
        return error_response(request, 422, in_api_words(str(exc)))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect) -> Response:
        # the client closed the connection before its body arrived: nobody to answer, nothing
        # wrong here. 499 (nginx's "client closed request") in the access log and the metrics,
        # not a 500 with a traceback
        return Response(status_code=CLIENT_CLOSED)

    @app.exception_handler(sqlite3.DatabaseError)
    async def _database(request: Request, exc: sqlite3.DatabaseError) -> JSONResponse:
        if not unusable_database(exc):
            return internal_error(request, exc)
        # a full disk, a locked, corrupt, deleted or unreadable file: the server's trouble, not
        # the request's
        rid = request_id(request.scope)
        log.error("database error: %s", exc, extra={"request_id": rid})
        return error_response(request, 503, f"the server's database cannot be used now ({exc}); "
                              "the request was not completed; retry later (the server's operator "
                              "should check its disk and database file)", {"Retry-After": "30"})

    @app.exception_handler(Exception)  # what InternalErrors does not see (the outer middleware's)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        return internal_error(request, exc)


def unusable_database(exc: BaseException) -> bool:
    """An error of the database itself (full disk, lock, corrupt or replaced file), not of the
    server's SQL (a constraint, a wrong statement: those are bugs, answered 500)."""
    return type(exc) is sqlite3.DatabaseError or isinstance(exc, sqlite3.OperationalError)


def internal_error(request: Request, exc: BaseException) -> JSONResponse:
    rid = request_id(request.scope)
    log.error("unhandled error", exc_info=exc, extra={"request_id": rid})
    return error_response(request, 500, f"internal error ({type(exc).__name__}); the server "
                          f"logged it with request id {rid}")


class JSONCORS(CORSMiddleware):
    """CORS, with a refused preflight in the one error shape (Starlette answers it text/plain)."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "OPTIONS":
            headers = Headers(scope=scope)
            if "origin" in headers and "access-control-request-method" in headers:
                plain = self.preflight_response(request_headers=headers)
                if plain.status_code == 400:
                    keep = {k: v for k, v in plain.headers.items()
                            if k.lower().startswith("access-control-") or k.lower() == "vary"}
                    reason = bytes(plain.body).decode()
                    await error_response(Request(scope), 400, (
                        f"{reason}: a cross-origin request this server does not allow (its "
                        "PIPEPLAN_CORS_ORIGINS lists the origins it takes; any method and header from "
                        "those)"), keep)(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)


class InternalErrors:
    """A route's unexpected exception answered as the one JSON 500 and logged once, with the
    request id. Starlette's handler for Exception answers and then raises the exception again,
    so uvicorn logged a second traceback, without the request id."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking)
        except Exception as exc:
            if started:  # too late for an answer: the server closes the connection
                raise
            await internal_error(Request(scope), exc)(scope, receive, send)


async def _retention(app: FastAPI, settings: Settings, lock: threading.Lock) -> None:
    """Sweep now and every retention_interval_s. The sweep holds `lock`: shutdown takes it before
    closing the database, so a sweep is never cut off mid-query."""
    def sweep() -> dict[str, int]:
        with lock:
            return app.state.storage.prune(settings.keep_jobs, settings.keep_jobs_s,
                                           settings.keep_renders, settings.keep_renders_s)

    while True:
        try:
            deleted = await run_in_threadpool(sweep)
            if any(deleted.values()):
                log.info("retention deleted %s", deleted)
        except Exception:  # noqa: BLE001 - retention must never stop the server
            log.exception("retention sweep failed")
        await asyncio.sleep(settings.retention_interval_s)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        held = lock_database(settings.db)  # before the next line: another server's jobs are live
        try:
            storage = Storage(settings.db)
            lost = storage.fail_unfinished_jobs(LOST)
        except BaseException:
            if held is not None:
                held.close()
            raise
        if lost:
            log.warning("%d job(s) left unfinished by the previous server marked failed", lost)
        manager = JobManager(storage, settings.workers, settings.queue_size, observe=metrics.solve,
                             memory_mb=settings.worker_memory_mb)
        renders = RenderPool(settings.render_workers, settings.render_queue_size, settings.render_timeout_s,
                             settings.worker_memory_mb)
        manager.start()
        renders.start()
        app.state.storage, app.state.jobs, app.state.renders = storage, manager, renders
        metrics.gauges.update({
            "pipeplan_jobs_queued": lambda: manager.stats()["queued"],
            "pipeplan_jobs_running": lambda: manager.stats()["running"],
            "pipeplan_jobs_capacity": lambda: manager.capacity,
            "pipeplan_solver_workers": lambda: manager.workers,
            "pipeplan_renders_in_flight": renders.depth,
        })
        sweep_lock = threading.Lock()
        sweeper = asyncio.create_task(_retention(app, settings, sweep_lock))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            manager.stop()
            renders.stop()
            with sweep_lock:  # a sweep still running in its thread finishes first
                storage.close()
            if held is not None:
                held.close()

    app = FastAPI(
        title="pipeplan",
        version=API_VERSION,
        description="Pipeline-parallel training plans as a service: store profiles, plan them on "
                    "a cluster, look at past plans and their timelines. Every error is JSON "
                    "`{detail, request_id}`; send `X-Request-ID` to choose the id.",
        lifespan=lifespan,
        openapi_url=None,  # served by api.docs, without the API key (it holds no data)
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.rate = RateLimiter(settings.quota_requests_per_minute)
    app.state.before_body = before_body  # every JSON body is under /v1, behind the client check
    app.state.max_values = value_limits(settings.max_layers, settings.max_edges)
    app.state.prechecks = {Profile: service.precheck_profile_body,
                           PlanRequest: service.precheck_plan_body,
                           CompareRequest: service.precheck_plan_body}
    # middleware: the last added runs first
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes,
                       timeout_s=settings.body_timeout_s,
                       authorized=lambda headers: key_is_valid(headers, settings))
    if settings.cors_origins:
        app.add_middleware(JSONCORS, allow_origins=settings.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-ID", "Location", "ETag",
                                                                "Retry-After"])
    app.add_middleware(GZipMiddleware, minimum_size=settings.gzip_min_bytes)
    # outside gzip: a HEAD's headers are its GET's, compressed where the GET is (inside, it
    # named the plain length and no encoding beside the same ETag; an outside review)
    app.add_middleware(HeadAsGet, router=app.router)
    app.add_middleware(InternalErrors)
    app.add_middleware(RequestContext, metrics=metrics)
    install_error_handlers(app)

    app.include_router(health.router)
    check = require_client if settings.keyed else open_client
    for module in ROUTERS[1:]:
        app.include_router(module.router, dependencies=[Depends(check)])
    openapi.install(app, settings)
    docs.install(app)
    return app
