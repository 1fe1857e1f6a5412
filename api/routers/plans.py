"""/v1/plans: plan (solved in a worker process; 201 if done within a short wait, else 202 and a
job to poll), read, list, delete, draw the timeline, export the Chrome trace, and compare methods.

A stored plan never changes, so plans and their pictures carry an `ETag` and
`Cache-Control: immutable` (`If-None-Match` answers 304). Timelines are drawn by the render pool
(worker processes), never in the HTTP process, and kept in storage once drawn.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from api import service
from api.body import StrictJSONRoute
from api.deps import ClientDep, JobsDep, RendersDep, SettingsDep, StorageDep
from api.jobs import JobManager, Outcome, QueueFull, Task
from api.pool import RenderPool
from api.routers.common import Limit, Offset, errors
from api.schemas import (
    CompareOut,
    CompareRequest,
    CompareRow,
    JobOut,
    PlanOut,
    PlanPage,
    PlanRequest,
    PlanSummary,
)
from api.settings import Settings
from api.storage import PlanRow, Storage
from api.wording import shown_id
from planner.formats import option_conflicts
from planner.solve import METHODS

router = APIRouter(prefix="/v1/plans", tags=["plans"], route_class=StrictJSONRoute)
IMMUTABLE = "private, max-age=31536000, immutable"
RENDER_VERSION = "2"  # part of a picture's ETag: bump when the drawing changes

ACCEPTED = {202: {"model": JobOut, "description": "still solving: poll the job (Location header)"}}


# ---------------------------------------------------------------- helpers


async def _submit(jobs: JobManager, settings: Settings, **kwargs: Any) -> tuple[Task, bool]:
    """The job and whether this request made it (False: it joined the same request's job)."""
    try:
        return await run_in_threadpool(lambda: jobs.submit(**kwargs))
    except QueueFull as exc:
        raise HTTPException(503, detail=f"every worker is busy and the queue is full ({exc}); retry later",
                            headers={"Retry-After": str(settings.retry_after_s)}) from None


async def _wait(task: Task, timeout_s: float) -> Outcome | None:
    if timeout_s <= 0:  # no short wait: always answer 202 with the job, however fast it ran
        return None
    fut = asyncio.wrap_future(task.future)
    done, _ = await asyncio.wait({fut}, timeout=timeout_s)
    return fut.result() if done else None


def _failure(outcome: Outcome) -> HTTPException:
    code = {"user": 422, "quota": 413, "cancelled": 409, "shutdown": 503, "timeout": 504}.get(outcome.error_kind or "", 500)
    return HTTPException(code, detail=outcome.error or "the job failed")


async def _accepted(storage: Storage, settings: Settings, task: Task) -> JSONResponse:
    job = await run_in_threadpool(storage.get_job, task.job_id)
    assert job is not None
    body = jsonable_encoder(service.job_out(job))
    return JSONResponse(body, status_code=202, headers={
        "Location": f"/v1/jobs/{job.id}", "Retry-After": str(settings.poll_after_s)})


def _plan_row(storage: Storage, plan_id: str) -> PlanRow:
    row = storage.get_plan(plan_id)
    if row is None:
        raise HTTPException(404, detail=f"no plan with id {shown_id(plan_id)}")
    return row


# ---------------------------------------------------------------- routes


@router.post("", status_code=201, response_model=PlanOut,
             responses={200: {"model": PlanOut, "description": "the same request was solved before (or by "
                                                                "another request whose job this one joined)"},
                        **ACCEPTED, **errors(404, 409, 422, 503, 504)})
async def create_plan(req: PlanRequest, storage: StorageDep, settings: SettingsDep, jobs: JobsDep,
                      client: ClientDep, response: Response) -> Any:
    """Plan `profile` (or `profile_id`) on `cluster` with `options`. A time limit above the
    server's cap is clamped and reported in `warnings`. The heuristics answer within their
    `time_limit_s` plus the server's grace (`PIPEPLAN_SOLVE_GRACE_S`); the search (cpsat), whose
    budget is work, gives the command line's plan and is stopped only past its own wall-clock
    net (3 x the time its most work takes, `planner.search.wall_net_s`) plus the grace. A solve
    still running then is stopped and its job fails with error_kind "timeout"."""
    def lookup() -> tuple[service.Prepared, PlanRow | None]:
        prep = service.prepare(storage, settings, req, client)
        row = storage.get_plan_by_key(prep.key)
        if row is None:  # a new plan will be stored for this client: refuse if it is at its quota
            service.check_quota(storage, settings, client, 1, "a new plan")
        return prep, row

    prep, cached = await run_in_threadpool(lookup)
    if cached is not None:
        response.status_code = 200
        response.headers["Location"] = f"/v1/plans/{cached.id}"
        return service.plan_out(cached, True, prep.warnings)
    task, created = await _submit(
        jobs, settings, kind="plan", key=prep.key, profile_id=prep.profile_row.id,
        request=service.job_request(prep), payload=service.task_payload(prep, "plan"),
        grace_s=settings.solve_grace_s,
        on_result=service.plan_handler(storage, settings, prep, client), owner=client,
    )
    outcome = await _wait(task, settings.sync_wait_s)
    if outcome is None:
        return await _accepted(storage, settings, task)
    if outcome.status != "succeeded" or outcome.plan_id is None:
        raise _failure(outcome)
    row = await run_in_threadpool(storage.get_plan, outcome.plan_id)
    if row is None:  # solved and stored, then deleted by another request before this answer
        raise HTTPException(409, detail=f"the plan was solved and stored as {shown_id(outcome.plan_id)}, "
                            "but a DELETE removed it before this answer; send the request again "
                            "to solve it again")
    response.headers["Location"] = f"/v1/plans/{row.id}"
    if not created:  # it joined the job of the same request in flight: that one solved the plan
        response.status_code = 200
    return service.plan_out(row, not created, prep.warnings)


@router.post("/compare", response_model=CompareOut,
             responses={**ACCEPTED, **errors(404, 409, 422, 503, 504)})
async def compare(req: CompareRequest, storage: StorageDep, settings: SettingsDep, jobs: JobsDep,
                  client: ClientDep) -> Any:
    """The same profile and cluster under several methods, one row each (plans are stored and
    cached like single plans; `plan_id` links each row to its plan). Each method has its own
    deadline (as for a single plan); one that runs over gets an error row."""
    methods = req.methods or [m for m in METHODS if m != "manual"]
    methods = list(dict.fromkeys(methods))
    if len(methods) > settings.max_compare_methods:
        raise service.limit_error(["body", "methods"], f"{len(methods)} methods; at most "
                                  f"{settings.max_compare_methods} per comparison")
    base = await run_in_threadpool(service.prepare, storage, settings, req, client)
    ignored = [f for f in service.MANUAL_ONLY if getattr(base.options, f) is not None]
    if ignored and any(m != "manual" for m in methods):
        base = replace(base, warnings=[*base.warnings, (
            f"options.{', options.'.join(ignored)}: read by method manual only; the other methods "
            "planned without them")])
    done: dict[str, CompareRow] = {}
    missing = []
    for method in methods:
        mprep = service.method_prepared(base, method)
        conflict = option_conflicts(mprep.options, lambda f: f"options.{f}")
        if conflict:  # what a single plan request with this method is refused for
            done[method] = CompareRow(method=method, status="error", error=conflict)
            continue
        service.check_limits(mprep.profile, mprep.cluster, mprep.options, settings)
        row = await run_in_threadpool(storage.get_plan_by_key, mprep.key)
        if row is not None and row.body is not None:
            done[method] = service.compare_row(method, row.id, row.body)
        else:
            missing.append(method)
    if not missing:
        return service.compare_table(base.profile_row.id, methods, done, base.warnings)
    await run_in_threadpool(service.check_quota, storage, settings, client, 1,
                            f"{len(missing)} new plan(s)")
    # the key holds every method asked for, in order, and those still to solve: a request for
    # other methods joined an in-flight comparison of the same missing ones and got its table
    # (an outside review: [cpsat] answered with [blocks, cpsat])
    key = "compare:" + service.cache_key(base.profile_row.sha256, base.cluster, base.options.model_copy(
        update={"method": json.dumps({"methods": methods, "missing": missing})}))
    task, _ = await _submit(
        jobs, settings, kind="compare", key=key, profile_id=base.profile_row.id,
        request=service.job_request(base, methods), payload=service.task_payload(base, "compare", missing),
        grace_s=settings.solve_grace_s,
        on_result=service.compare_handler(storage, settings, base, methods, done, client), owner=client,
    )
    outcome = await _wait(task, settings.sync_wait_s)
    if outcome is None:
        return await _accepted(storage, settings, task)
    if outcome.status != "succeeded":
        raise _failure(outcome)
    return outcome.result


@router.get("", response_model=PlanPage, responses=errors(422))
def list_plans(storage: StorageDep, limit: Limit = 20, offset: Offset = 0,
               profile_id: Annotated[str | None, Query(min_length=1, description="only this "
                                                       "profile's plans")] = None) -> PlanPage:
    """Stored plans, oldest first; `profile_id` keeps only that profile's plans (an empty one is
    a 422, as an empty `status` of /v1/jobs is: it listed every plan)."""
    rows, total = storage.list_plans(limit, offset, profile_id)
    items = [PlanSummary(id=r.id, profile_id=r.profile_id, method=r.method, iteration_ms=r.iteration_ms,
                         created_at=r.created_at) for r in rows]
    return PlanPage(items=items, total=total, limit=limit, offset=offset)


@router.api_route("/compare", methods=["GET", "DELETE", "PUT", "PATCH", "OPTIONS", "HEAD", "TRACE"],
                  include_in_schema=False)
def compare_wrong_method() -> None:
    """/v1/plans/compare only takes POST (not a plan id)."""
    raise HTTPException(405, detail="/v1/plans/compare takes POST only", headers={"Allow": "POST"})


compare_wrong_method.refuses_method = True  # type: ignore[attr-defined]


def _etag_match(request: Request, etag: str) -> bool:
    given = request.headers.get("if-none-match", "")
    return given.strip() == "*" or etag in [t.strip().removeprefix("W/") for t in given.split(",")]


def _not_modified(etag: str) -> Response:
    return Response(status_code=304, headers={"ETag": etag, "Cache-Control": IMMUTABLE})


@router.get("/{plan_id}", response_model=PlanOut,
            responses={304: {"description": "If-None-Match matched: not modified"}, **errors(404)})
def get_plan(plan_id: str, storage: StorageDep, request: Request) -> Response:
    """A stored plan (ETag; a plan never changes once stored)."""
    etag = f'"plan-{plan_id}"'
    if _etag_match(request, etag) and storage.plan_exists(plan_id):
        return _not_modified(etag)
    out = service.plan_out(_plan_row(storage, plan_id), True, [])
    return JSONResponse(out.model_dump(mode="json"), headers={"ETag": etag, "Cache-Control": IMMUTABLE})


@router.delete("/{plan_id}", status_code=204, response_class=Response, responses=errors(404))
def delete_plan(plan_id: str, storage: StorageDep) -> Response:
    if not storage.delete_plan(plan_id):
        raise HTTPException(404, detail=f"no plan with id {shown_id(plan_id)}")
    return Response(status_code=204)


MEDIA = {"svg": "image/svg+xml", "png": "image/png", "trace": "application/json"}


async def _render(request: Request, storage: Storage, settings: Settings, renders: RenderPool,
                  plan_id: str, kind: str) -> Response:
    """A picture (or trace) of the plan: from storage, else drawn by the render pool."""
    etag = f'"{kind}-{plan_id}-{RENDER_VERSION}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE}
    cached = await run_in_threadpool(storage.get_render, plan_id, kind)
    if cached is not None:
        if _etag_match(request, etag):
            return _not_modified(etag)
        return Response(cached, media_type=MEDIA[kind], headers=headers)
    row = await run_in_threadpool(_plan_row, storage, plan_id)
    limit = settings.trace_max_events if kind == "trace" else settings.timeline_max_events
    payload = {"kind": "render", "plan": row.body, "format": kind, "max_events": limit,
               "title": f"{row.method} plan {row.id[:8]}: "}
    try:
        future = renders.submit(f"{plan_id}:{kind}", payload)
    except QueueFull as exc:
        raise HTTPException(503, detail=f"every render worker is busy and the queue is full ({exc}); "
                            "retry later", headers={"Retry-After": str(settings.retry_after_s)}) from None
    status, value = await asyncio.wrap_future(future)
    if status == "user":
        raise HTTPException(422, detail=str(value))
    if status == "timeout":  # as a solve past its deadline: the server's limit, not a fault
        raise HTTPException(504, detail=f"drawing the {kind} took longer than this server allows "
                            f"({settings.render_timeout_s:g} s, PIPEPLAN_RENDER_TIMEOUT_S); the plan "
                            f"is stored: GET /v1/plans/{plan_id}, save its `plan` field as plan.json "
                            "and look at it locally (`python -m planner simulate plan.json --timeline`, "
                            "or `--trace trace.json` for Perfetto)")
    if status != "ok":
        raise HTTPException(500, detail=f"drawing the timeline failed: {status}: {value}")
    await run_in_threadpool(storage.put_render, plan_id, kind, value)
    if _etag_match(request, etag):
        return _not_modified(etag)
    return Response(value, media_type=MEDIA[kind], headers=headers)


IMAGE = {200: {"content": {"image/svg+xml": {}, "image/png": {}}, "description": "the Gantt chart"},
         304: {"description": "If-None-Match matched: not modified"}}


@router.get("/{plan_id}/timeline.svg", response_class=Response,
            responses={**IMAGE, **errors(404, 422, 503, 504)})
async def timeline_svg(plan_id: str, request: Request, storage: StorageDep, settings: SettingsDep,
                       renders: RendersDep) -> Response:
    """Gantt chart of the simulated schedule: one row per rank, forward/backward coloured,
    idle time (bubbles) shaded; large schedules aggregated per pixel."""
    return await _render(request, storage, settings, renders, plan_id, "svg")


@router.get("/{plan_id}/timeline.png", response_class=Response,
            responses={**IMAGE, **errors(404, 422, 503, 504)})
async def timeline_png(plan_id: str, request: Request, storage: StorageDep, settings: SettingsDep,
                       renders: RendersDep) -> Response:
    return await _render(request, storage, settings, renders, plan_id, "png")


@router.get("/{plan_id}/trace.json", response_class=Response,
            responses={200: {"content": {"application/json": {}}, "description": "Chrome trace"},
                       304: {"description": "If-None-Match matched: not modified"},
                       **errors(404, 422, 503, 504)})
async def trace(plan_id: str, request: Request, storage: StorageDep, settings: SettingsDep,
                renders: RendersDep) -> Response:
    """The Chrome trace (chrome://tracing, Perfetto) of the simulated schedule."""
    return await _render(request, storage, settings, renders, plan_id, "trace")
