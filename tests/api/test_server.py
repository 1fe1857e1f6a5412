"""A real uvicorn on 127.0.0.1: plan over HTTP with httpx, restart, read the plan back; a job the
server was running when it was killed is reported failed after the restart, not lost."""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.api.conftest import plan_body, slow_body, wait_job
from tests.api.server import Server


def test_plan_over_http_survives_restart(tmp_path: Path) -> None:
    server = Server(tmp_path / "pipeplan.db")
    with server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/healthz").json()["workers"] == 2
            r = http.post("/v1/plans", json=plan_body("blocks"))
            if r.status_code == 202:  # a loaded machine: not solved within the short wait
                job = wait_job(http, r.json()["id"])  # type: ignore[arg-type]
                assert job["status"] == "succeeded", job
                r = http.get(f"/v1/plans/{job['plan_id']}")
            assert r.status_code in (200, 201), r.text
            plan = r.json()
            again = http.post("/v1/plans", json=plan_body("blocks"))
            assert again.status_code == 200 and again.json()["id"] == plan["id"]
            assert http.get("/docs").status_code == 200
            assert http.get("/openapi.json").json()["paths"].keys() >= {"/v1/plans", "/healthz"}
    # stopped (SIGTERM); a new server on the same database and another port
    with Server(tmp_path / "pipeplan.db") as restarted:
        with httpx.Client(base_url=restarted.url, timeout=60) as http:
            back = http.get(f"/v1/plans/{plan['id']}")
            assert back.status_code == 200 and back.json()["plan"] == plan["plan"]
            assert http.get("/v1/plans").json()["total"] == 1
            assert http.post("/v1/plans", json=plan_body("blocks")).json()["cached"] is True


def _slow_job(http: httpx.Client) -> str:
    """Start a job that keeps the one worker busy (CP-SAT, 20 s time limit); its id."""
    r = http.post("/v1/plans", json=slow_body())
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


@pytest.mark.parametrize(("sig", "kind"), [(signal.SIGKILL, "lost"), (signal.SIGTERM, "shutdown")])
def test_job_running_when_the_server_stops_is_reported_failed(tmp_path: Path, sig: int, kind: str) -> None:
    """Killed: the next server marks the job failed at startup ("lost"). Stopped: the server
    itself stops the solve and records it failed before exiting ("shutdown")."""
    server = Server(tmp_path / "pipeplan.db", sync_wait_s="0", workers=1)
    with server:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            job_id = _slow_job(http)
        server.stop(sig)
    with Server(tmp_path / "pipeplan.db") as restarted:
        job = httpx.get(f"{restarted.url}/v1/jobs/{job_id}").json()
        assert job["status"] == "failed" and job["error_kind"] == kind
        assert "send the request again" in job["error"]


def test_a_second_server_on_the_same_database_is_refused_and_the_first_keeps_its_jobs(tmp_path: Path) -> None:
    """At its start a server marks the unfinished jobs it finds as lost: a second one on the same
    file would do that to the first one's live jobs. It is refused before it starts."""
    first = Server(tmp_path / "pipeplan.db", sync_wait_s="0", workers=1)
    with first:
        with httpx.Client(base_url=first.url, timeout=60) as http:
            job_id = _slow_job(http)
            second = Server(tmp_path / "pipeplan.db")
            with pytest.raises(RuntimeError, match="another pipeplan server"):
                second.start()
            assert http.get(f"/v1/jobs/{job_id}").json()["status"] in ("queued", "running")
            http.delete(f"/v1/jobs/{job_id}")
