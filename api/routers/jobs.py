"""/v1/jobs: list jobs (newest first, by status), poll one that did not finish within the POST's
short wait; DELETE cancels an unfinished job or deletes a finished one's record."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from fastapi import APIRouter, HTTPException, Query, Response
from fastapi.responses import JSONResponse

from api import service
from api.deps import JobsDep, SettingsDep, StorageDep
from api.jobs import JobManager
from api.routers.common import Limit, Offset, errors
from api.schemas import JobOut, JobPage
from api.storage import UNFINISHED, JobRow
from api.wording import shown_id

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

Status = Literal["queued", "running", "succeeded", "failed", "cancelled"]


@router.get("", response_model=JobPage, responses=errors(422))
def list_jobs(storage: StorageDep, jobs: JobsDep, limit: Limit = 20, offset: Offset = 0,
              status: Annotated[Status | None, Query(description="only jobs with this status")] = None
              ) -> JobPage:
    """Jobs, newest first."""
    jobs.flush_unstored()
    rows, total = storage.list_jobs(limit, offset, status)
    rows = [_as_kept(j, jobs) for j in rows]
    if status in UNFINISHED and (kept := jobs.unstored_ids()):
        # finished, but stored as unfinished until the database takes the write (a full disk):
        # not listed as unfinished, nor counted so on any page (they are not under their final
        # status either until the write goes through)
        rows = [j for j in rows if j.status == status]
        total -= sum(1 for i in kept if (row := storage.get_job(i)) is not None and row.status == status)
    return JobPage(items=[service.job_out(j) for j in rows], total=total, limit=limit, offset=offset)


def _as_kept(job: JobRow, jobs: JobManager) -> JobRow:
    """A job finished but whose outcome the database refused (a full disk): as kept in memory."""
    if job.status in UNFINISHED and (done := jobs.unstored_outcome(job.id)) is not None:
        return replace(job, status=done.status, error=done.error, error_kind=done.error_kind)
    return job


@router.get("/{job_id}", response_model=JobOut, responses=errors(404))
def get_job(job_id: str, storage: StorageDep, settings: SettingsDep, jobs: JobsDep) -> JSONResponse:
    """A job; while it is unfinished the answer carries Retry-After (when to poll again)."""
    jobs.flush_unstored()
    job = storage.get_job(job_id)
    if job is None:
        raise HTTPException(404, detail=f"no job with id {shown_id(job_id)}")
    job = _as_kept(job, jobs)
    headers = {"Retry-After": str(settings.poll_after_s)} if job.status in UNFINISHED else {}
    return JSONResponse(service.job_out(job).model_dump(mode="json"), headers=headers)


@router.delete("/{job_id}", response_model=JobOut,
               responses={204: {"description": "a finished job's record was deleted (or the record of "
                                     "the job this request cancelled, by another DELETE meanwhile)"},
                          **errors(404)})
def delete_job(job_id: str, storage: StorageDep, jobs: JobsDep) -> Response:
    """Cancel a queued or running job (a running solver process is killed; 200 with the job),
    or delete the record of a finished one (204; its plan stays)."""
    job = storage.get_job(job_id)
    if job is None:
        raise HTTPException(404, detail=f"no job with id {shown_id(job_id)}")
    if job.status in UNFINISHED:
        cancelled = jobs.cancel(job_id)  # (if it finished meanwhile: its final state)
        if cancelled is None:  # another DELETE removed the record of the job this one ended
            return Response(status_code=204)
        return JSONResponse(service.job_out(cancelled).model_dump(mode="json"))
    if not storage.delete_job(job_id):
        raise HTTPException(404, detail=f"no job with id {shown_id(job_id)}")
    return Response(status_code=204)
