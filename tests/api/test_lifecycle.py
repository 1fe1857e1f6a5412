"""The server's processes and time budgets, on a real server on 127.0.0.1: after `kill -9`
no solver outlives it, the next server marks the jobs lost and serves every stored plan; every
planning method answers within its deadline (the heuristics' time limit, the search's own
wall-clock net) plus the grace, whatever the problem size."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from planner.formats import PlanOptions
from planner.solve import cpsat_available, solve_deadline_s
from tests.api.conftest import plan_body, profile_doc, slow_body
from tests.api.server import Server


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited


def wait_running(http: httpx.Client, n: int, timeout_s: float = 60.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if http.get("/v1/jobs", params={"status": "running"}).json()["total"] >= n:
            return
        time.sleep(0.1)
    raise AssertionError(f"{n} jobs never ran at once")


@pytest.mark.skipif(not cpsat_available(), reason="needs CP-SAT for a 60 s solve")
def test_kill_9_leaves_no_solver_and_the_restart_serves_every_plan(tmp_path: Path) -> None:
    db = tmp_path / "pipeplan.db"
    server = Server(db, workers=2, sync_wait_s="0", max_time_limit_s="60")
    with server, httpx.Client(base_url=server.url, timeout=60) as http:
        stored = []
        for method in ("blocks", "uniform"):
            r = http.post("/v1/plans", json=plan_body(method))
            assert r.status_code == 202
            end = time.monotonic() + 30
            while (job := http.get(r.headers["location"]).json())["status"] != "succeeded":
                assert time.monotonic() < end, job
                time.sleep(0.05)
            stored.append(http.get(f"/v1/plans/{job['plan_id']}").json())
        jobs = [http.post("/v1/plans", json=slow_body(limit)).json()["id"] for limit in (60.0, 59.0)]
        wait_running(http, 2)
        assert server.proc is not None
        procs = descendants(server.proc.pid)
        assert len(procs) >= 2
        server.stop(signal.SIGKILL)
        t0 = time.monotonic()
        while any(alive(p) for p in procs) and time.monotonic() - t0 < 5.0:
            time.sleep(0.1)
        left = [p for p in procs if alive(p)]
        assert not left, f"still alive 5 s after kill -9: {left}"
    with Server(db) as restarted, httpx.Client(base_url=restarted.url, timeout=60) as http:
        for job_id in jobs:
            job = http.get(f"/v1/jobs/{job_id}").json()
            assert job["status"] == "failed" and job["error_kind"] == "lost"
        for plan in stored:
            again = http.get(f"/v1/plans/{plan['id']}")
            assert again.status_code == 200 and again.json()["plan"] == plan["plan"]


def big_body(method: str, time_limit_s: float) -> dict:
    """5,000 layers on 4,096 devices (512 nodes x 8)."""
    body = plan_body(method, global_batch=4096, profile=profile_doc(n_layers=5_000, param_bytes=10_000_000))
    body["cluster"] = {"nodes": 512, "devices_per_node": 8, "device_memory_gb": 80,
                       "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25}
    body["options"].update(time_limit_s=time_limit_s, microbatch_size=8)
    return body


def test_every_method_keeps_its_deadline_on_5000_layers_4096_devices(tmp_path: Path) -> None:
    limit_s = 2.0
    methods = ["uniform", "blocks", "params", "pipedream"] + (["cpsat"] if cpsat_available() else [])
    with Server(tmp_path / "pipeplan.db", workers=1, sync_wait_s="60", solve_grace_s="1") as server, \
            httpx.Client(base_url=server.url, timeout=120) as http:
        profile = big_body("uniform", limit_s)["profile"]
        profile_id = http.post("/v1/profiles", json=profile).json()["id"]
        for method in methods:
            body = big_body(method, limit_s)
            del body["profile"]
            t0 = time.monotonic()
            r = http.post("/v1/plans", json={**body, "profile_id": profile_id})
            elapsed = time.monotonic() - t0
            # the deadline is limit + 1 s grace for the heuristics (unbounded, uniform takes
            # ~45 s), the search's own wall-clock net + 1 s for cpsat, whose budget is work (it
            # gives the command line's plan; here ~9 s); +3 s of slack for a CPU shared with
            # other work (benchmarks/api_load.py measures the figure itself)
            deadline_s = solve_deadline_s(PlanOptions.model_validate(body["options"])) + 1.0
            assert elapsed < deadline_s + 3.0, (method, elapsed)
            if r.status_code == 504:  # stopped at the deadline: a clear error, never a hang
                assert "time budget" in r.json()["detail"] and method in r.json()["detail"]
            else:
                assert r.status_code in (201, 422), (method, r.status_code, r.text[:300])
        assert http.get("/healthz").json()["running"] == 0


def test_compare_gives_each_method_its_own_budget(tmp_path: Path) -> None:
    """A method that runs over its budget gets an error row; the others still give plans."""
    from fastapi.testclient import TestClient

    from api.app import create_app
    from tests.api.conftest import make_settings

    # pipedream needs ~1-2 s here (more than 4 s, its budget before, when CI shared the two
    # cores with three other jobs; more than 5 beside three busy processes); uniform ~45 s
    limit_s = 12.0
    body = big_body("uniform", limit_s)
    body["methods"] = ["uniform", "pipedream"]
    with TestClient(create_app(make_settings(tmp_path, workers=1, sync_wait_s=60.0, solve_grace_s=0.5,
                                             max_time_limit_s=limit_s))) as c:
        t0 = time.monotonic()
        r = c.post("/v1/plans/compare", json=body)
        elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text[:300]
    rows = {row["method"]: row for row in r.json()["rows"]}
    assert rows["uniform"]["status"] == "error" and "time budget" in rows["uniform"]["error"]
    assert rows["pipedream"]["status"] == "ok" and rows["pipedream"]["plan_id"], rows["pipedream"]["error"]
    assert r.json()["best_method"] == "pipedream"
    assert elapsed < 2 * (limit_s + 0.5) + 6.0  # two budgets, plus slack for a shared CPU
