"""Many simultaneous plan requests against a real server (bounded: 24 requests, 2 workers): all
answered with the plan the planner gives directly, duplicates with the same stored plan, and
/healthz keeps answering while the workers are busy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from planner.solve import cpsat_available
from tests.api.conftest import direct, plan_body, without_wall
from tests.api.server import Server


async def _load(url: str, bodies: list[dict[str, Any]]) -> tuple[list[httpx.Response], list[dict]]:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        done = asyncio.Event()
        health: list[dict] = []

        async def poll_health() -> None:
            while not done.is_set():
                r = await http.get("/healthz")
                health.append({**r.json(), "http": r.status_code})
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll_health())
        try:
            responses = await asyncio.gather(*(http.post("/v1/plans", json=b) for b in bodies))
        finally:
            done.set()
            await poller
    return list(responses), health


def test_simultaneous_plans_all_correct(tmp_path: Path) -> None:
    distinct = [plan_body(m, global_batch=gb) for m in ("blocks", "uniform", "params")
                for gb in (16, 32, 64, 128)]
    bodies = distinct + distinct  # every request twice, all at once
    if cpsat_available():  # two long solves keep both workers busy for a while
        for limit in (3.0, 3.5):
            slow = plan_body("cpsat")
            slow["options"]["time_limit_s"] = limit
            bodies.insert(0, slow)
    with Server(tmp_path / "pipeplan.db", workers=2, queue_size="64", sync_wait_s="120") as server:
        responses, health = asyncio.run(_load(server.url, bodies))

    assert all(r.status_code in (200, 201) for r in responses), [r.text for r in responses if r.status_code > 201]
    ids: dict[str, str] = {}
    for body, r in zip(bodies, responses, strict=True):
        out = r.json()
        key = repr(body["options"])
        assert ids.setdefault(key, out["id"]) == out["id"]  # duplicates: one stored plan
        if body["options"]["method"] != "cpsat":
            assert without_wall(out["plan"]) == without_wall(direct(body))
    assert len(ids) == len({repr(b["options"]) for b in bodies})

    assert health and all(h["http"] == 200 for h in health)
    assert max(h["running"] for h in health) >= 1  # it answered while solves were running
