"""/v1/jobs: poll a solve that did not finish within the POST's short wait; DELETE cancels it."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from api import service
from api.deps import JobsDep, StorageDep
from api.routers.common import errors
from api.schemas import JobOut
from api.storage import UNFINISHED

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.get("/{job_id}", response_model=JobOut, responses=errors(401, 404))
def get_job(job_id: str, storage: StorageDep) -> JobOut:
    job = storage.get_job(job_id)
    if job is None:
        raise HTTPException(404, detail=f"no job with id {job_id!r}")
    return service.job_out(job)


@router.delete("/{job_id}", response_model=JobOut, responses=errors(401, 404, 409))
def cancel_job(job_id: str, storage: StorageDep, jobs: JobsDep) -> JobOut:
    """Cancel a queued or running job (a running solver process is killed)."""
    job = storage.get_job(job_id)
    if job is None:
        raise HTTPException(404, detail=f"no job with id {job_id!r}")
    if job.status not in UNFINISHED:
        raise HTTPException(409, detail=f"job {job_id} has already finished ({job.status})")
    job = jobs.cancel(job_id)
    assert job is not None
    return service.job_out(job)
