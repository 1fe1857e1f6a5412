"""What an operator and a client of a well-run service expect (TestClient unless said):
caching headers, gzip, CORS, Prometheus metrics, probes, the job list, deleting profiles and
jobs, retention, quotas on stored bytes, limits on extra fields, a cache that forgets plans of
another planner version, and /docs served without a CDN."""

from __future__ import annotations

import contextlib
import gzip
import re
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import service
from api.app import create_app
from api.storage import Storage
from tests.api.conftest import cluster_doc, make_settings, plan_body, profile_doc, wait_job


def test_plan_and_picture_caching_headers(client: TestClient) -> None:
    out = client.post("/v1/plans", json=plan_body("blocks"))
    cached = client.post("/v1/plans", json=plan_body("blocks"))
    assert cached.status_code == 200 and cached.headers["location"] == f"/v1/plans/{out.json()['id']}"
    url = out.headers["location"]
    first = client.get(url)
    etag = first.headers["etag"]
    assert "immutable" in first.headers["cache-control"]
    again = client.get(url, headers={"If-None-Match": etag})
    assert again.status_code == 304 and again.content == b""
    png = client.get(f"{url}/timeline.png")
    assert png.status_code == 200 and png.headers["etag"] != etag
    assert client.get(f"{url}/timeline.png", headers={"If-None-Match": png.headers["etag"]}).status_code == 304
    assert client.get(f"{url}/timeline.png", headers={"If-None-Match": '"other"'}).status_code == 200


def test_gzip_and_cors(tmp_path: Path) -> None:
    with TestClient(create_app(make_settings(tmp_path, cors_origins="https://ui.example"))) as c:
        out = c.post("/v1/plans", json=plan_body("blocks")).json()
        r = c.get(f"/v1/plans/{out['id']}", headers={"Accept-Encoding": "gzip"})
        assert r.headers["content-encoding"] == "gzip"
        head = c.head(f"/v1/plans/{out['id']}", headers={"Accept-Encoding": "gzip"})
        assert head.status_code == 200 and head.content == b""
        assert {k: head.headers.get(k) for k in ("content-encoding", "content-length", "etag")} == {
            k: r.headers.get(k) for k in ("content-encoding", "content-length", "etag")}, head.headers
        raw = c.get(f"/v1/plans/{out['id']}", headers={"Accept-Encoding": "identity"})
        assert "content-encoding" not in raw.headers and len(raw.content) > 1024
        pre = c.options("/v1/plans", headers={"Origin": "https://ui.example",
                                             "Access-Control-Request-Method": "POST"})
        assert pre.headers["access-control-allow-origin"] == "https://ui.example"
        other = c.get("/healthz", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers
        # a refused preflight is the one JSON error (Starlette's is text/plain)
        refused = c.options("/v1/plans", headers={"Origin": "https://evil.example",
                                                 "Access-Control-Request-Method": "POST"})
        assert refused.status_code == 400 and refused.headers["content-type"] == "application/json"
        assert "Disallowed CORS origin" in refused.json()["detail"] and refused.json()["request_id"]
        # the trailing-slash redirect names no host (it named the one the Host header gave)
        moved = c.get("/v1/jobs/?limit=2", headers={"Host": "evil.example"}, follow_redirects=False)
        assert moved.status_code == 307 and moved.headers["location"] == "/v1/jobs?limit=2", moved.headers
    assert gzip.decompress(gzip.compress(b"x")) == b"x"


def test_metrics_and_probes(client: TestClient) -> None:
    client.post("/v1/plans", json=plan_body("blocks"))
    client.get("/v1/plans/nope")
    text = client.get("/metrics").text
    assert re.search(r'pipeplan_http_requests_total\{route="/v1/plans/\{plan_id\}",method="GET",status="404"\} 1', text)
    assert 'pipeplan_http_request_duration_seconds_bucket{route="/v1/plans",method="POST",le="+Inf"} 1' in text
    assert re.search(r'pipeplan_solve_duration_seconds_count\{kind="plan",method="blocks",outcome="ok"\} 1', text)
    assert "pipeplan_jobs_queued 0" in text and "pipeplan_solver_workers 2" in text
    # methods a client invents share one series: /metrics does not grow with them
    for k in range(3):
        client.request(f"BREW{k}" + "X" * 1000, "/v1/plans")
    text = client.get("/metrics").text
    assert "BREW" not in text
    assert re.search(r'pipeplan_http_requests_total\{route="/v1/plans",method="other",status="405"\} 3', text), text
    assert client.get("/livez").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["database"] and ready.json()["workers"]
    version = client.get("/version").json()
    assert version["planner"] == service.planner_version() and version["planner"].startswith(version["pipeplan"])


def test_readyz_fails_when_the_database_is_read_only(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    with TestClient(create_app(settings)) as c:
        storage = c.app.state.storage
        storage.writable = lambda: (_ for _ in ()).throw(OSError("read-only file system"))
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["database"] is False
        assert "read-only" in r.json()["detail"]


def test_readyz_and_writes_fail_when_the_database_file_is_deleted_or_replaced(tmp_path: Path) -> None:
    """`/readyz` answered "ready" after the database files were deleted: its probe's write
    created a new, empty file, and writes went on into it. Now the file must be the one the
    server opened and hold the service's tables."""
    import os

    settings = make_settings(tmp_path)
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").status_code == 200
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(settings.db + suffix)
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["database"] is False
        assert "was deleted" in r.json()["detail"], r.json()
        # the probe is open to every client: the file's name, not where it lies
        assert os.path.basename(settings.db) in r.json()["detail"] and str(tmp_path) not in r.json()["detail"]
        r = c.post("/v1/profiles", json=profile_doc())
        assert r.status_code == 503 and "was deleted" in r.json()["detail"]
        assert r.headers["retry-after"] == "30"
        # a read on a thread with no connection yet: sqlite3 made a new empty file there
        import threading

        from api.storage import DatabaseReplaced

        got: list[BaseException] = []

        def read() -> None:
            try:
                c.app.state.storage.list_jobs(10, 0)
            except BaseException as exc:  # noqa: BLE001 - what the read raised, checked below
                got.append(exc)

        t = threading.Thread(target=read)
        t.start()
        t.join()
        assert len(got) == 1 and isinstance(got[0], DatabaseReplaced) and not os.path.exists(settings.db)
        open(settings.db, "wb").close()  # a new file at the path: not the database opened
        r = c.get("/readyz")
        assert r.status_code == 503 and "replaced by another file" in r.json()["detail"]


def test_a_corrupt_database_is_a_503_and_a_bug_a_500_logged_once(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """"database disk image is malformed" (sqlite3.DatabaseError, not OperationalError) was a
    500; an unexpected exception was answered and then raised again (uvicorn logged it twice,
    the second time without the request id; TestClient raises it)."""
    import sqlite3

    with TestClient(create_app(make_settings(tmp_path))) as c:
        storage = c.app.state.storage

        def corrupt(*a: object, **k: object) -> None:
            raise sqlite3.DatabaseError("database disk image is malformed")

        def bug(*a: object, **k: object) -> None:
            raise KeyError("oops")

        storage.list_jobs = corrupt
        r = c.get("/v1/jobs")
        assert r.status_code == 503 and "malformed" in r.json()["detail"], r.text
        storage.list_jobs = bug
        caplog.clear()
        r = c.get("/v1/jobs")  # TestClient raises what the app raises
        assert r.status_code == 500 and "KeyError" in r.json()["detail"] and r.json()["request_id"]
        assert [rec.getMessage() for rec in caplog.records if rec.levelname == "ERROR"] == ["unhandled error"]


def test_job_list_newest_first_with_status_filter(tmp_path: Path) -> None:
    with TestClient(create_app(make_settings(tmp_path, sync_wait_s=0.0))) as c:
        ids = []
        for gb in (16, 32, 64):
            r = c.post("/v1/plans", json=plan_body("blocks", global_batch=gb))
            assert r.status_code == 202 and r.headers["retry-after"] == "1"
            ids.append(r.json()["id"])
            wait_job(c, ids[-1])
        bad = c.post("/v1/plans", json=plan_body("blocks", cluster={**plan_body()["cluster"], "device_memory_gb": 0.01}))
        wait_job(c, bad.json()["id"])
        page = c.get("/v1/jobs").json()
        assert [j["id"] for j in page["items"]] == [bad.json()["id"], *ids[::-1]] and page["total"] == 4
        ok = c.get("/v1/jobs", params={"status": "succeeded", "limit": 2}).json()
        assert [j["id"] for j in ok["items"]] == ids[::-1][:2] and ok["total"] == 3
        assert c.get("/v1/jobs", params={"status": "failed"}).json()["items"][0]["error_kind"] == "user"
        assert c.get("/v1/jobs", params={"status": "bogus"}).status_code == 422


def test_delete_profile_takes_its_plans(client: TestClient) -> None:
    out = client.post("/v1/plans", json=plan_body("blocks")).json()
    client.get(f"/v1/plans/{out['id']}/timeline.svg")
    assert client.delete(f"/v1/profiles/{out['profile_id']}").status_code == 204
    assert client.get(f"/v1/profiles/{out['profile_id']}").status_code == 404
    assert client.get(f"/v1/plans/{out['id']}").status_code == 404
    assert client.get(f"/v1/plans/{out['id']}/timeline.svg").status_code == 404
    assert client.delete(f"/v1/profiles/{out['profile_id']}").status_code == 404


def test_retention_of_jobs_and_renders(tmp_path: Path) -> None:
    s = Storage(str(tmp_path / "db.sqlite"))
    profile, _ = s.put_profile("sha", "m.py", 1, {})
    plan = s.put_plan("k", profile.id, "blocks", {"predicted": {"iteration_ms": 1.0}}, {})
    jobs = [s.create_job("plan", f"k{i}", profile.id, {}) for i in range(5)]
    for job in jobs[:4]:
        s.finish_job(job.id, "succeeded", plan_id=plan.id)
    for kind in ("svg", "png", "trace"):
        s.put_render(plan.id, kind, b"x")
    later = datetime.now(UTC) + timedelta(days=2)
    assert s.prune(keep_jobs=2, keep_jobs_s=0, keep_renders=0, keep_renders_s=0) == {"jobs": 2, "renders": 0}
    assert s.list_jobs(10, 0)[1] == 3  # 2 finished kept, the unfinished one never pruned
    assert s.prune(0, 86_400, 2, 0) == {"jobs": 0, "renders": 1}
    assert s.prune(0, 86_400, 0, 86_400, at=later) == {"jobs": 2, "renders": 2}
    assert [j.id for j in s.list_jobs(10, 0)[0]] == [jobs[4].id]


def test_extra_fields_are_bounded(tmp_path: Path) -> None:
    with TestClient(create_app(make_settings(tmp_path, max_extra_bytes=1000))) as c:
        small = {**profile_doc(), "notes": "x" * 500}
        assert c.post("/v1/profiles", json=small).status_code == 201
        big = profile_doc()
        for layer in big["layers"]:
            layer["comment"] = "y" * 200  # 8 layers x ~210 bytes
        r = c.post("/v1/profiles", json=big)
        assert r.status_code == 422 and "PIPEPLAN_MAX_EXTRA_BYTES" in r.text


def test_stored_bytes_quota_per_client(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, api_keys="alice:k-a,bob:k-b", quota_stored_bytes=4_000)
    with TestClient(create_app(settings)) as c:
        alice, bob = {"Authorization": "Bearer k-a"}, {"Authorization": "Bearer k-b"}
        assert c.post("/v1/profiles", json=profile_doc(n_layers=8), headers=alice).status_code == 201
        over = c.post("/v1/profiles", json=profile_doc(n_layers=20), headers=alice)
        assert over.status_code == 413 and "alice" in over.json()["detail"]
        assert c.post("/v1/profiles", json=profile_doc(n_layers=20), headers=bob).status_code == 201
        first = c.get("/v1/profiles", headers=alice).json()["items"][0]["id"]
        assert c.delete(f"/v1/profiles/{first}", headers=alice).status_code == 204
        assert c.post("/v1/profiles", json=profile_doc(n_layers=12), headers=alice).status_code == 201


def test_stored_bytes_quota_holds_for_uploads_in_parallel(tmp_path: Path) -> None:
    """Twelve different profiles sent at once each passed the quota check before any was
    written: 2.5x the quota was stored. The check and the write are now one step."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.api.server import Server

    quota = 6_000  # room for about four of them
    docs = [profile_doc(n_layers=8, fwd_ms=1.0 + k / 100, name=f"m{k}") for k in range(12)]
    with Server(tmp_path / "pipeplan.db", quota_stored_bytes=str(quota)) as server:
        with ThreadPoolExecutor(12) as pool:
            codes = list(pool.map(lambda d: httpx.post(f"{server.url}/v1/profiles", json=d, timeout=60).status_code,
                                  docs))
        assert sorted(set(codes)) == [201, 413], codes
        assert 2 <= codes.count(201) <= 5, codes
    stored = Storage(str(tmp_path / "pipeplan.db"))
    try:
        assert stored.stored_bytes("") <= quota
    finally:
        stored.close()


def _grandchildren() -> list[int]:
    """Processes whose parent is a child of this one (the solvers, under the forkserver)."""
    import os

    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    children = {p for p, pp in parent.items() if pp == os.getpid()}
    return [p for p, pp in parent.items() if pp in children]


def test_a_solver_killed_from_outside_is_named_in_the_job(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """kill -9 of a busy solver (the out-of-memory killer) failed its job with "exit code None"
    (read before the process was reaped) and logged nothing."""
    import os
    import signal

    from tests.api.conftest import slow_body

    with TestClient(create_app(make_settings(tmp_path, sync_wait_s=0.0, workers=1,
                                             max_time_limit_s=30.0))) as c:
        job_id = c.post("/v1/plans", json=slow_body()).json()["id"]
        for _ in range(600):
            if c.get(f"/v1/jobs/{job_id}").json()["status"] == "running" and _grandchildren():
                break
            time.sleep(0.05)
        for pid in _grandchildren():
            os.kill(pid, signal.SIGKILL)
        job = wait_job(c, job_id)
        assert job["status"] == "failed" and job["error_kind"] == "internal", job
        assert "killed by SIGKILL" in job["error"], job
    assert any("solver process died" in r.getMessage() for r in caplog.records)


def test_cache_key_holds_the_planner_version(client: TestClient, monkeypatch) -> None:
    first = client.post("/v1/plans", json=plan_body("blocks")).json()
    assert client.post("/v1/plans", json=plan_body("blocks")).json()["id"] == first["id"]
    monkeypatch.setattr(service, "planner_version", lambda: "9.9.9+upgraded")
    after = client.post("/v1/plans", json=plan_body("blocks"))
    assert after.status_code == 201 and after.json()["id"] != first["id"]


def test_no_security_in_the_schema_without_keys(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    ops = [op for item in schema["paths"].values() for op in item.values()]
    assert not any("security" in op or "401" in op["responses"] for op in ops)
    cluster = schema["components"]["schemas"]["Cluster"]
    uniform = next(f for f in cluster["oneOf"] if f["title"] == "uniform")
    assert set(uniform["required"]) == {"nodes", "devices_per_node", "device_memory_gb"}
    assert all("500" in op["responses"] for op in ops)


def test_docs_are_served_without_a_cdn(client: TestClient) -> None:
    page = client.get("/docs").text
    sources = re.findall(r'(?:src|href)="([^"]+)"', page) + re.findall(r"url: '([^']+)'", page)
    assert sources and all(s.startswith("/") for s in sources), sources  # nothing from another host
    for asset in re.findall(r"(/docs/assets/[\w.-]+)", page):
        r = client.get(asset)
        assert r.status_code == 200 and len(r.content) > 500, asset
    assert "/docs/assets/swagger-ui-bundle.js" in page


def test_access_log_lines_are_json_with_the_request_id(client: TestClient, caplog) -> None:
    import json
    import logging

    from api.observe import JsonFormatter

    with caplog.at_level(logging.INFO, logger="api.access"):
        client.get("/v1/plans/nope", headers={"X-Request-ID": "log-me"})
    [record] = [r for r in caplog.records if r.name == "api.access"]
    line = json.loads(JsonFormatter().format(record))
    assert line["request_id"] == "log-me" and line["status"] == 404
    assert line["route"] == "/v1/plans/{plan_id}" and line["level"] == "info"


def test_plans_solved_at_once_are_kept_within_the_quota_but_one(tmp_path: Path) -> None:
    """Each plan request passes the stored-bytes check before its solve, when nothing of the
    others is stored yet: six distinct plans solving at once were all kept against a quota of two
    (75 kB of 20). The check is made again under the quota's lock when a plan is stored, so a
    client goes over by one plan at most, as when its requests come one by one; the others get
    a 413 that says why."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.api.server import Server

    sizes = []
    with Server(tmp_path / "pipeplan.db", sync_wait_s="60") as probe:  # what a profile and one plan store
        pid = httpx.post(f"{probe.url}/v1/profiles", json=profile_doc(), timeout=60).json()["id"]
        sizes.append(_stored(tmp_path / "pipeplan.db"))
        body = {"profile_id": pid, "cluster": cluster_doc(), "options": {"method": "uniform", "global_batch": 32}}
        assert httpx.post(f"{probe.url}/v1/plans", json=body, timeout=60).status_code == 201
        sizes.append(_stored(tmp_path / "pipeplan.db"))
    profile_bytes, plan_bytes = sizes[0], sizes[1] - sizes[0]
    db = tmp_path / "b.db"
    quota = profile_bytes + plan_bytes // 2  # room for the profile and half a plan
    with Server(db, workers=3, quota_stored_bytes=str(quota), sync_wait_s="60") as server:
        pid = httpx.post(f"{server.url}/v1/profiles", json=profile_doc(), timeout=60).json()["id"]
        bodies = [{"profile_id": pid, "cluster": cluster_doc(),
                   "options": {"method": "uniform", "global_batch": 32 * k}} for k in range(1, 7)]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda b: httpx.post(f"{server.url}/v1/plans", json=b, timeout=120), bodies))
    codes = [a.status_code for a in answers]
    assert codes.count(201) == 1 and codes.count(413) == 5, codes
    assert all("PIPEPLAN_QUOTA_STORED_BYTES" in a.json()["detail"] for a in answers if a.status_code == 413)
    assert _stored(db) <= quota + 1.5 * plan_bytes


def _stored(db: Path) -> int:
    stored = Storage(str(db))
    try:
        return stored.stored_bytes("anonymous")  # (the client without API keys)
    finally:
        stored.close()


def test_a_worker_killed_before_its_task_is_sent_is_a_death_not_a_broken_pipe() -> None:
    """A solver killed between its start and the task's send (CI caught the test above in that
    window) failed the job with "internal error: [Errno 32] Broken pipe"."""
    import os
    import signal

    from api.pool import WorkerProcess, context

    proc = WorkerProcess(context(), "pipeplan-test")
    try:
        assert proc.pid is not None
        os.kill(proc.pid, signal.SIGKILL)
        proc.proc.join(10)
        status, how = proc.run({"kind": "plan"}, 5.0, lambda: False)
        assert status == "died" and "killed by SIGKILL" in how, (status, how)
    finally:
        proc.close(kill=True)


def test_the_text_log_writes_a_client_s_line_breaks_escaped() -> None:
    """`serve --log-format text`: a request path is the client's, percent-decoded, so `%0a` put
    a line of the client's making in the server's log (an outside review forged an access-log
    line with it). Control characters in a message are written escaped; the message's own
    arguments are unchanged for the JSON log."""
    import logging

    from api.observe import TextFormatter, log_config

    config = log_config("info", json_lines=False)["formatters"]["main"]
    assert config["()"] is TextFormatter
    fmt = TextFormatter(config["fmt"])
    path = "/v1/plans/x\n2026-12-07 INFO api.access DELETE /v1/profiles/ALL 204\r\x1b[2K\u2028"
    record = logging.LogRecord("api.access", logging.INFO, __file__, 1, "%s %s %d", ("GET", path, 404), None)
    line = fmt.format(record)
    assert "\n" not in line and "\r" not in line and "\x1b" not in line and "\u2028" not in line
    assert line.endswith("GET /v1/plans/x\\n2026-12-07 INFO api.access DELETE /v1/profiles/ALL 204"
                         "\\r\\x1b[2K\\u2028 404")
