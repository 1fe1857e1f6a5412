"""GET /healthz: answers from memory (no database, no solver), so it stays fast while every
worker is busy; never needs the API key."""

from __future__ import annotations

from fastapi import APIRouter

from api.deps import JobsDep
from api.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz(jobs: JobsDep) -> Health:
    return Health(status="ok", **jobs.stats())
