"""What the routers share: paging parameters and the documented error responses."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query

from api.schemas import ErrorOut

Limit = Annotated[int, Query(ge=1, le=100, description="page size")]
Offset = Annotated[int, Query(ge=0, le=1_000_000_000, description="items to skip")]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        401: "missing or wrong API key (only when the server sets PIPEPLAN_API_KEY)",
        404: "no such resource",
        409: "the job has already finished",
        413: "request body over the size limit",
        422: "the request is malformed, over a limit, or cannot be planned (the detail says why)",
        500: "a bug in the planner (the detail says where)",
        503: "every worker is busy and the queue is full; retry after Retry-After seconds",
        504: "the solve took longer than its time limit plus grace and was stopped",
    }
    return {c: {"model": ErrorOut, "description": text[c]} for c in codes}
