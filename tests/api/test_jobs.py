"""The job queue under pressure (TestClient): a full queue answers 503 with Retry-After, the same
request joins the job in flight, DELETE cancels a queued job and kills a running solve; a
long CP-SAT solve is the command line's."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from planner.solve import cpsat_available
from tests.api.conftest import direct, make_settings, plan_body, slow_body, without_wall

needs_cpsat = pytest.mark.skipif(not cpsat_available(), reason="needs planner.cpsat for a long solve")


def wait_for(client: TestClient, job_id: str, statuses: set[str], timeout_s: float = 30.0) -> dict:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} never reached {statuses}: {job}")


@needs_cpsat
def test_queue_full_join_and_cancel(tmp_path) -> None:
    settings = make_settings(tmp_path, workers=1, queue_size=1, sync_wait_s=0.0, retry_after_s=7,
                             max_time_limit_s=60.0)
    with TestClient(create_app(settings)) as c:
        first = c.post("/v1/plans", json=slow_body(50.0))
        assert first.status_code == 202, first.text
        running = wait_for(c, first.json()["id"], {"running"})
        second = c.post("/v1/plans", json=slow_body(49.0))  # another key: waits in the queue
        assert c.get(f"/v1/jobs/{running['id']}").json()["status"] == "running", (
            "the 'slow' CP-SAT request finished early; make conftest.slow_body harder")
        assert second.status_code == 202 and second.json()["status"] == "queued"
        assert c.get("/healthz").json() | {"capacity": 2} == {
            "status": "ok", "workers": 1, "running": 1, "queued": 1, "capacity": 2}

        full = c.post("/v1/plans", json=plan_body("blocks"))
        assert full.status_code == 503 and full.headers["retry-after"] == "7"
        assert "queue is full" in full.json()["detail"]

        joined = c.post("/v1/plans", json=slow_body(50.0))  # same request: joins the first job
        assert joined.status_code == 202 and joined.json()["id"] == running["id"]

        cancelled = c.delete(f"/v1/jobs/{second.json()['id']}")
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
        gone = c.delete(f"/v1/jobs/{running['id']}")
        assert gone.status_code == 200 and gone.json()["status"] == "cancelled"
        # the running solve (50 s time limit) was killed: the worker frees up long before that
        end = time.monotonic() + 20.0
        while c.get("/healthz").json()["running"] and time.monotonic() < end:
            time.sleep(0.05)
        assert c.get("/healthz").json()["running"] == 0
        assert wait_for(c, running["id"], {"cancelled"})["error_kind"] == "cancelled"

        ok = c.post("/v1/plans", json=plan_body("blocks"))
        assert ok.status_code == 202  # sync_wait_s = 0: every new solve is a job
        assert wait_for(c, ok.json()["id"], {"succeeded"})["plan_id"]


@needs_cpsat
def test_cpsat_plan_with_a_short_time_limit(client: TestClient) -> None:
    body = plan_body("cpsat")
    body["options"]["time_limit_s"] = 2.0
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    assert plan["solver"]["name"] == "cpsat" and plan["options"]["time_limit_s"] == 2.0
    # CP-SAT is never worse than the baselines it is hinted with (minimising iteration time)
    blocks = client.post("/v1/plans", json=plan_body("blocks")).json()["plan"]
    assert plan["predicted"]["iteration_ms"] <= blocks["predicted"]["iteration_ms"] + 1e-6


@needs_cpsat
def test_cpsat_plan_is_the_command_lines_where_its_work_outlasts_the_time_limit(tmp_path) -> None:
    """The search's budget is work, not time: the service lets it do all of that work, as the
    command line does, so the same request gives the command line's plan from any server,
    also where the work takes longer than `time_limit_s` on the wall clock (here about 1.2x on
    our 2 cores). Stopped on the clock at 1x, as the service did until 2026-12-01, the search
    gave a plan with `clock_stopped` (the real GNMT profile on 16 devices at 1 GB/s, 10 s, two
    such solves at once: 346.0 and 350.2 ms)."""
    body = slow_body(0.5)
    with TestClient(create_app(make_settings(tmp_path, workers=1))) as c:
        r = c.post("/v1/plans", json=body)
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    assert plan["solver"]["clock_stopped"] is False
    assert without_wall(plan) == without_wall(direct(body))


def test_a_database_that_refuses_the_outcome_fails_the_job_and_keeps_the_dispatcher(tmp_path) -> None:
    """A full disk when a job's outcome is written: the job answers failed (never 'running'
    forever), the same request solves again, the dispatcher thread lives on, and the outcome
    reaches the database once it takes writes again."""
    import sqlite3

    settings = make_settings(tmp_path, workers=1, sync_wait_s=0.0)
    with TestClient(create_app(settings)) as c:
        storage = c.app.state.storage
        real = storage.finish_job
        refused: list[str] = []
        full = [True]  # the first job's outcome is refused until the disk has room

        def full_disk(job_id: str, *args, **kw):
            if not refused or (job_id in refused and full[0]):
                refused[:] = [job_id]
                raise sqlite3.OperationalError("database or disk is full")
            return real(job_id, *args, **kw)

        storage.finish_job = full_disk
        first = c.post("/v1/plans", json=plan_body("blocks"))
        assert first.status_code == 202
        job = wait_for(c, first.json()["id"], {"failed", "succeeded"})
        assert refused == [job["id"]]
        assert job["status"] == "failed" and job["error_kind"] == "internal"
        assert "could not store" in job["error"]
        assert c.get("/readyz").status_code == 200  # the dispatcher thread is alive
        listed = {j["id"]: j for j in c.get("/v1/jobs").json()["items"]}  # as the job itself
        assert listed[job["id"]]["status"] == "failed", listed
        for status in ("queued", "running"):
            page = c.get("/v1/jobs", params={"status": status}).json()
            assert job["id"] not in [j["id"] for j in page["items"]] and page["total"] == 0, page
        full[0] = False

        again = c.post("/v1/plans", json=plan_body("blocks"))  # not joined to the failed job
        assert again.status_code in (200, 202) and again.json()["id"] != job["id"]
        if again.status_code == 202:
            assert wait_for(c, again.json()["id"], {"succeeded"})["plan_id"]
        # the refused write goes through once the database takes writes (here, with the poll)
        assert c.get(f"/v1/jobs/{job['id']}").json()["status"] == "failed"
        assert storage.get_job(job["id"]).status == "failed"


@needs_cpsat
def test_comparisons_of_other_methods_are_not_joined(tmp_path) -> None:
    """Two comparisons in flight join only where they ask for the same methods: one of
    [blocks, cpsat] with blocks cached and one of [cpsat] solved the same missing method and
    were one job, so the second got the first's table (an outside review)."""
    body = slow_body(1.0)
    with TestClient(create_app(make_settings(tmp_path, workers=1, sync_wait_s=0.0))) as c:
        cached = c.post("/v1/plans", json={**body, "options": {**body["options"], "method": "blocks"}})
        wait_for(c, cached.json()["id"], {"succeeded"}, 60)
        both = c.post("/v1/plans/compare", json={**body, "methods": ["blocks", "cpsat"]})
        one = c.post("/v1/plans/compare", json={**body, "methods": ["cpsat"]})
        assert both.status_code == one.status_code == 202, (both.text, one.text)
        assert both.json()["id"] != one.json()["id"]
        for r, methods in ((both, ["blocks", "cpsat"]), (one, ["cpsat"])):
            job = wait_for(c, r.json()["id"], {"succeeded", "failed"}, 120)
            assert [row["method"] for row in job["result"]["rows"]] == methods, job


def test_a_job_waiting_for_the_database_does_not_hold_the_health_routes(tmp_path) -> None:
    """A plan whose job insert waits for SQLite's write lock (another process writing: a slow
    disk, a checkpoint) held the job manager's lock, which /healthz takes on the event loop:
    every route waited with it, 5 s in an outside review. /healthz answers at once now."""
    import sqlite3
    import threading

    settings = make_settings(tmp_path, workers=1, sync_wait_s=0.0)
    with TestClient(create_app(settings)) as c:
        stored = c.post("/v1/plans", json=plan_body("uniform"))  # the profile is stored now
        wait_for(c, stored.json()["id"], {"succeeded"})
        holder = sqlite3.connect(settings.db, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the write lock, held for 3 s
        answers: list[int] = []
        post = threading.Thread(target=lambda: answers.append(
            c.post("/v1/plans", json=plan_body("blocks")).status_code))
        post.start()
        time.sleep(0.5)  # the POST is waiting for the lock now
        t0 = time.monotonic()
        health = c.get("/healthz")
        waited = time.monotonic() - t0
        time.sleep(max(0.0, 3.0 - waited))
        holder.execute("COMMIT")
        holder.close()
        post.join(60)
        assert health.status_code == 200 and waited < 1.5, waited
        assert answers and answers[0] in (201, 202), answers


def test_a_plan_deleted_before_its_answer_is_a_409(tmp_path) -> None:
    """A DELETE between the solve's store and its answer (the POST read the plan back and said
    404 "no plan with id ..." for an id the client never knew): 409, send it again."""
    with TestClient(create_app(make_settings(tmp_path, workers=1))) as c:
        storage = c.app.state.storage
        real = storage.get_plan

        def deleted_meanwhile(plan_id: str):
            storage.delete_plan(plan_id)
            return real(plan_id)

        storage.get_plan = deleted_meanwhile
        r = c.post("/v1/plans", json=plan_body("blocks"))
        storage.get_plan = real
        assert r.status_code == 409 and "send the request again" in r.json()["detail"], r.text
        again = c.post("/v1/plans", json=plan_body("blocks"))
        assert again.status_code == 201, again.text


@needs_cpsat
def test_a_job_whose_record_another_delete_removes_while_cancelling_answers_204(tmp_path) -> None:
    """Two DELETEs of a queued job at once: the one that cancels it finds its record gone when
    the other (seeing it cancelled) deleted it; that was an AssertionError and a 500 (an outside
    review, 12 concurrent DELETEs). The interleaving is made here: the record is deleted right
    after the cancel, as the other request would."""
    settings = make_settings(tmp_path, workers=1, queue_size=2, sync_wait_s=0.0, max_time_limit_s=60.0)
    with TestClient(create_app(settings)) as c:
        first = c.post("/v1/plans", json=slow_body(50.0))
        wait_for(c, first.json()["id"], {"running"})
        queued = c.post("/v1/plans", json=slow_body(49.0)).json()
        assert queued["status"] == "queued"
        jobs = c.app.state.jobs
        cancel = jobs.cancel

        def cancel_then_other_delete(job_id: str):
            row = cancel(job_id)
            assert row is not None and row.status == "cancelled"
            assert c.app.state.storage.delete_job(job_id)  # the other DELETE, meanwhile
            return jobs.storage.get_job(job_id)

        jobs.cancel = cancel_then_other_delete
        r = c.delete(f"/v1/jobs/{queued['id']}")
        assert r.status_code == 204, r.text
        assert c.delete(f"/v1/jobs/{queued['id']}").status_code == 404
        jobs.cancel = cancel
        assert c.delete(f"/v1/jobs/{first.json()['id']}").status_code == 200


@needs_cpsat
def test_requests_that_join_a_job_in_flight_answer_200_cached(tmp_path) -> None:
    """Identical requests at once share one job; only the one that made it answers 201 with
    cached false (every one did, against the schema's "false only in the response whose request
    solved this plan")."""
    from concurrent.futures import ThreadPoolExecutor

    settings = make_settings(tmp_path, workers=1, sync_wait_s=60.0, max_time_limit_s=60.0)
    with TestClient(create_app(settings)) as c:
        body = slow_body(1.0)
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: c.post("/v1/plans", json=body), range(4)))
        seen = sorted((r.status_code, r.json()["cached"]) for r in answers)
        assert seen == [(200, True)] * 3 + [(201, False)], [r.text[:200] for r in answers]
        assert len({r.json()["id"] for r in answers}) == 1
