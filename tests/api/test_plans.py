"""Plans over HTTP (TestClient), checked against the planner called directly: the same plan,
cached on the second request, listed, deleted, drawn, traced, compared; bad requests get the
right status with the field or the planner's message."""

from __future__ import annotations

import io
import xml.etree.ElementTree as ET

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.storage import Storage
from api.wording import in_api_words
from planner.errors import PipeplanError
from planner.formats import Plan
from planner.simulator import simulate
from tests.api.conftest import (
    cluster_doc,
    direct,
    make_settings,
    plan_body,
    profile_doc,
    wait_job,
    without_wall,
)


@pytest.mark.parametrize("method", ["blocks", "uniform", "pipedream"])
def test_plan_equals_planner_and_is_cached(client: TestClient, method: str) -> None:
    body = plan_body(method)
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["cached"] is False and out["method"] == method and out["warnings"] == []
    assert without_wall(out["plan"]) == without_wall(direct(body))
    assert r.headers["location"] == f"/v1/plans/{out['id']}"

    again = client.post("/v1/plans", json=body)
    assert again.status_code == 200 and again.json()["cached"] is True
    assert again.json()["id"] == out["id"] and again.json()["plan"] == out["plan"]

    by_id = {"profile_id": out["profile_id"], "cluster": body["cluster"], "options": body["options"]}
    r = client.post("/v1/plans", json=by_id)
    assert r.status_code == 200 and r.json()["id"] == out["id"]
    assert client.get(f"/v1/plans/{out['id']}").json()["plan"] == out["plan"]


def test_list_filter_delete(client: TestClient) -> None:
    a = [client.post("/v1/plans", json=plan_body(m)).json() for m in ("blocks", "uniform")]
    other = plan_body("blocks", profile=profile_doc(n_layers=5))
    b = client.post("/v1/plans", json=other).json()
    assert a[0]["profile_id"] == a[1]["profile_id"] != b["profile_id"]

    page = client.get("/v1/plans").json()
    assert page["total"] == 3 and [p["id"] for p in page["items"]] == [a[0]["id"], a[1]["id"], b["id"]]
    only_a = client.get("/v1/plans", params={"profile_id": a[0]["profile_id"]}).json()
    assert [p["id"] for p in only_a["items"]] == [a[0]["id"], a[1]["id"]]
    second = client.get("/v1/plans", params={"limit": 1, "offset": 1}).json()
    assert [p["id"] for p in second["items"]] == [a[1]["id"]]

    assert client.delete(f"/v1/plans/{a[0]['id']}").status_code == 204
    assert client.get(f"/v1/plans/{a[0]['id']}").status_code == 404
    assert client.delete(f"/v1/plans/{a[0]['id']}").status_code == 404
    assert client.get("/v1/plans").json()["total"] == 2
    # deleted from the cache too: the same request is solved again, under a new id
    r = client.post("/v1/plans", json=plan_body("blocks"))
    assert r.status_code == 201 and r.json()["id"] != a[0]["id"]


def test_timeline_and_trace(client: TestClient) -> None:
    out = client.post("/v1/plans", json=plan_body("blocks")).json()
    plan = Plan.model_validate(out["plan"])
    sim = simulate(plan)

    svg = client.get(out["links"]["timeline_svg"])
    assert svg.status_code == 200 and svg.headers["content-type"] == "image/svg+xml"
    root = ET.fromstring(svg.content)
    texts = ["".join(t.itertext()) for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for rank, stage in sim.stage_of_rank.items():
        assert f"rank {rank} (stage {stage})" in texts
    assert any(f"iteration {sim.iteration_ms:.3f} ms" in t for t in texts)
    assert {"forward", "backward", "idle (bubble)"} <= set(texts)

    png = client.get(out["links"]["timeline_png"])
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png.content), format="png")
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100

    trace = client.get(out["links"]["trace"])
    from planner.trace import chrome_trace

    assert trace.status_code == 200 and trace.json() == chrome_trace(sim)
    assert client.get("/v1/plans/nope/timeline.svg").status_code == 404
    assert client.get("/v1/plans/nope/trace.json").status_code == 404


def test_timeline_too_large_is_422(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path, timeline_max_events=10))) as c:
        out = c.post("/v1/plans", json=plan_body("blocks")).json()  # 4 microbatches x 2 stages
        n = 2 * out["plan"]["num_microbatches"] * len(out["plan"]["stages"])
        n += sum(s["replicas"] for s in out["plan"]["stages"] if s["replicas"] > 1)
        assert n == len(simulate(Plan.model_validate(out["plan"])).events) > 10
        r = c.get(out["links"]["timeline_svg"])
        assert r.status_code == 422 and f"has {n} events" in r.json()["detail"]
        assert c.get(out["links"]["trace"]).status_code == 200  # its own, larger limit


def test_time_limit_clamped_and_reported(client: TestClient, settings) -> None:
    body = plan_body("blocks")
    body["options"]["time_limit_s"] = 999.0
    out = client.post("/v1/plans", json=body).json()
    assert out["plan"]["options"]["time_limit_s"] == settings.max_time_limit_s == 5.0
    [warning] = out["warnings"]
    assert "999" in warning and "clamped to 5" in warning


def test_unfittable_cluster_is_422_with_memory_needed(client: TestClient) -> None:
    body = plan_body("blocks", cluster=cluster_doc(per_node=2, memory_gb=0.01))
    with pytest.raises(PipeplanError) as expected:
        direct(body)
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422
    # the same message, the command line's flags named as the request's fields
    assert r.json()["detail"] == in_api_words(str(expected.value))
    assert "memory" in r.json()["detail"].lower()


def test_errors_name_the_request_fields_not_the_command_line_flags(client: TestClient) -> None:
    body = {"profile": profile_doc(n_layers=12), "cluster": cluster_doc(nodes=1, per_node=4),
            "options": {"method": "manual", "split": [3, 9, 2], "global_batch": 16, "microbatch_size": 8}}
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422, r.text
    assert "options.split 3,9,2 covers 14 layers" in r.json()["detail"] and "--" not in r.json()["detail"]


def test_bad_plan_requests(client: TestClient) -> None:
    r = client.post("/v1/plans", json={"profile_id": "nope", "cluster": cluster_doc()})
    assert r.status_code == 404 and "nope" in r.json()["detail"]

    r = client.post("/v1/plans", json={"cluster": cluster_doc()})
    assert r.status_code == 422 and "exactly one of profile" in r.text

    body = plan_body()
    body["cluster"]["intra_node_gb_per_s"] = 0
    [err] = client.post("/v1/plans", json=body).json()["detail"]
    assert err["loc"] == ["body", "cluster", "intra_node_gb_per_s"] and "greater than 0" in err["msg"]

    body = plan_body()
    body["options"]["global_batch"] = 30
    body["options"]["microbatch_size"] = 4
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422 and "not a multiple of microbatch size 4" in r.text

    body = plan_body(global_batch=8 * 10_000)  # 10 000 microbatches > the cap of 4 096
    [err] = client.post("/v1/plans", json=body).json()["detail"]
    assert err["loc"] == ["body", "options", "global_batch"] and "10000 microbatches" in err["msg"]

    body = plan_body("no-such-method")
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422 and "no-such-method" in r.text


def test_slow_request_becomes_a_job(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path, sync_wait_s=0.0))) as c:
        body = plan_body("pipedream")
        r = c.post("/v1/plans", json=body)
        assert r.status_code == 202, r.text
        job = r.json()
        assert r.headers["location"] == f"/v1/jobs/{job['id']}" and job["kind"] == "plan"
        done = wait_job(c, job["id"])
        assert done["status"] == "succeeded" and done["error"] is None
        plan = c.get(f"/v1/plans/{done['plan_id']}").json()["plan"]
        assert without_wall(plan) == without_wall(direct(body))
        assert c.delete(f"/v1/jobs/{job['id']}").status_code == 204  # finished: record deleted
        assert c.get(f"/v1/jobs/{job['id']}").status_code == 404
        assert c.get(f"/v1/plans/{done['plan_id']}").status_code == 200  # its plan stays
        assert c.get("/v1/jobs/nope").status_code == 404
        assert c.delete("/v1/jobs/nope").status_code == 404

        compare = c.post("/v1/plans/compare", json={**body, "methods": ["blocks", "uniform"]})
        assert compare.status_code == 202 and compare.json()["kind"] == "compare"
        table = wait_job(c, compare.json()["id"])["result"]
        assert [row["method"] for row in table["rows"]] == ["blocks", "uniform"]
        assert all(row["status"] == "ok" and row["plan_id"] for row in table["rows"])

        bad = c.post("/v1/plans", json=plan_body("blocks", cluster=cluster_doc(memory_gb=0.01)))
        failed = wait_job(c, bad.json()["id"])
        assert failed["status"] == "failed" and failed["error_kind"] == "user"
        assert "memory" in failed["error"].lower()


def test_compare_matches_each_method(client: TestClient) -> None:
    methods = ["blocks", "uniform", "pipedream"]
    body = {**plan_body(), "methods": methods}
    r = client.post("/v1/plans/compare", json=body)
    assert r.status_code == 200, r.text
    table = r.json()
    assert [row["method"] for row in table["rows"]] == methods
    for row in table["rows"]:
        ref = direct({**body, "options": {**body["options"], "method": row["method"]}})
        assert row["status"] == "ok"
        assert row["iteration_ms"] == ref["predicted"]["iteration_ms"]
        assert row["replicas"] == [s["replicas"] for s in ref["stages"]]
        plan = client.get(f"/v1/plans/{row['plan_id']}").json()
        assert plan["method"] == row["method"]
    best = min(table["rows"], key=lambda row: row["iteration_ms"])
    assert table["best_method"] == best["method"]

    # the plans are cached: a single-method request and a second comparison reuse them
    single = client.post("/v1/plans", json=plan_body("uniform"))
    assert single.status_code == 200 and single.json()["id"] == table["rows"][1]["plan_id"]
    assert client.post("/v1/plans/compare", json=body).json() == table


def test_plans_and_jobs_survive_restart(tmp_path) -> None:
    settings = make_settings(tmp_path)
    with TestClient(create_app(settings)) as c:
        out = c.post("/v1/plans", json=plan_body("blocks")).json()
    # what a crashed server leaves behind: a job still marked running
    storage = Storage(settings.db)
    lost = storage.create_job("plan", "k", out["profile_id"], {"warnings": []})
    assert storage.mark_running(lost.id)
    storage.close()
    with TestClient(create_app(settings)) as c:
        assert c.get(f"/v1/plans/{out['id']}").json()["plan"] == out["plan"]
        job = c.get(f"/v1/jobs/{lost.id}").json()
        assert job["status"] == "failed" and job["error_kind"] == "lost"
        assert "send the request again" in job["error"]


def test_schedule_auto_and_max_tp_over_http(client: TestClient) -> None:
    """The service plans through the same search: `schedule: auto` returns the schedule it
    chose (the request's options keep `auto`), `max_tp` is accepted, a bad schedule is a 422."""
    body = plan_body("cpsat")
    body["options"].update(schedule="auto", max_tp=1)
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 201, r.text
    plan = r.json()["plan"]
    assert plan["schedule"] in ("1f1b", "gpipe", "zb-h1") and plan["options"]["schedule"] == "auto"
    assert plan["options"]["max_tp"] == 1 and all(s.get("tp", 1) == 1 for s in plan["stages"])
    assert plan["solver"]["name"] == "cpsat" and plan["predicted"]["fits_memory"]
    body["options"]["schedule"] = "zero-bubble-please"
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 422 and "schedule" in r.text


def test_compare_plans_each_method_with_the_options_it_reads(client: TestClient) -> None:
    """A comparison's manual-only options (split, replicas) are left out of the other methods'
    plans, with a warning, so a stored plan never says it used them and its cache key is the
    single request's; an option a method cannot honour (microbatch_sizes outside cpsat) gives
    that method an error row, as a single request would be refused."""
    body = plan_body(methods=["manual", "blocks"])
    body["options"] |= {"split": [4, 4], "microbatch_size": 8}
    table = client.post("/v1/plans/compare", json=body).json()
    rows = {r["method"]: r for r in table["rows"]}
    assert rows["manual"]["status"] == "ok" and rows["manual"]["replicas"] == [1, 1]
    assert any("read by method manual only" in w for w in table["warnings"])
    blocks = client.get(f"/v1/plans/{rows['blocks']['plan_id']}").json()
    assert blocks["plan"]["options"]["split"] is None
    single = plan_body("blocks")
    single["options"]["microbatch_size"] = 8
    same = client.post("/v1/plans", json=single)
    assert same.status_code == 200 and same.json()["id"] == rows["blocks"]["plan_id"]

    sizes = plan_body(methods=["pipedream", "blocks"])
    sizes["options"]["microbatch_sizes"] = [4, 8]
    table = client.post("/v1/plans/compare", json=sizes).json()
    assert [r["status"] for r in table["rows"]] == ["error", "error"]
    assert "microbatch_sizes is for options.method cpsat" in table["rows"][0]["error"]


def test_compare_counts_the_stored_bytes_quota(tmp_path) -> None:
    settings = make_settings(tmp_path, api_keys="alice:k-a", quota_stored_bytes=4_000)
    alice = {"Authorization": "Bearer k-a"}
    with TestClient(create_app(settings)) as c:
        assert c.post("/v1/profiles", json=profile_doc(n_layers=8), headers=alice).status_code == 201
        pid = c.get("/v1/profiles", headers=alice).json()["items"][0]["id"]
        body = {"profile_id": pid, "cluster": cluster_doc(), "methods": ["blocks", "uniform"],
                "options": {"global_batch": 32, "microbatch_size": 8}}
        while (r := c.post("/v1/plans/compare", json=body, headers=alice)).status_code == 200:
            body["options"]["global_batch"] *= 2  # new plans until the quota is reached
        assert r.status_code == 413 and "2 new plan(s)" in r.json()["detail"], r.text
        single = {"profile_id": pid, "cluster": cluster_doc(),
                  "options": {**body["options"], "method": "blocks"}}
        assert c.post("/v1/plans", json=single, headers=alice).status_code == 413


def test_the_microbatch_limit_counts_the_sizes_the_planner_plans(tmp_path) -> None:
    """With microbatch_sizes, the profile's batch size (8 here) is not planned: 64 / 16 = 4
    microbatches is within a limit of 4 (it was refused as 8, with advice the request could
    not follow)."""
    with TestClient(create_app(make_settings(tmp_path, max_microbatches=4))) as c:
        body = plan_body("cpsat", global_batch=64)
        body["options"]["microbatch_sizes"] = [16, 32]
        r = c.post("/v1/plans", json=body)
        assert r.status_code in (200, 201), r.text
        assert r.json()["plan"]["microbatch_size"] in (16, 32)
        body["options"]["microbatch_sizes"] = [4, 32]
        over = c.post("/v1/plans", json=body)
        assert over.status_code == 422 and "raise the smallest of microbatch_sizes" in over.text


def test_the_microbatch_limit_counts_the_divisor_the_planner_takes(tmp_path) -> None:
    """Without a microbatch size the planner takes the largest divisor of global_batch up to the
    profile's batch size (8): a prime global batch of 37 is 37 microbatches of 1, not ceil(37 /
    8) = 5 (an outside review's 509 planned 509 microbatches past a limit of 64)."""
    with TestClient(create_app(make_settings(tmp_path, max_microbatches=8))) as c:
        over = c.post("/v1/plans", json=plan_body("blocks", global_batch=37))
        assert over.status_code == 422 and "37 microbatches" in over.text, over.text
        ok = c.post("/v1/plans", json=plan_body("blocks", global_batch=40))
        assert ok.status_code == 201 and ok.json()["plan"]["num_microbatches"] == 5, ok.text
