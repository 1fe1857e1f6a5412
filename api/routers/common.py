"""What the routers share: paging parameters and the documented error responses."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Query

from api.schemas import ErrorOut

Limit = Annotated[int, Query(ge=1, le=100, description="page size")]
Offset = Annotated[int, Query(ge=0, le=1_000_000_000, description="items to skip")]


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        404: "no such resource",
        409: "conflicts with the resource's state (the detail says how)",
        413: "request body over the size limit, or over the client's stored-bytes quota",
        422: "the request is malformed, over a limit, or cannot be planned (the detail says why)",
        500: "a bug in the server or the planner (the detail says where)",
        503: "every worker is busy and the queue is full; retry after Retry-After seconds",
        504: "the solve did not finish within its time budget and was stopped",
    }
    return {c: {"model": ErrorOut, "description": text[c]} for c in codes}
