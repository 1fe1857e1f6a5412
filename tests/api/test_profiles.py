"""Profiles over HTTP: validated, deduplicated by sha256, read back, paged; bad bodies say which
field and why; oversized bodies 413; the API key guards every route but /healthz."""

from __future__ import annotations

import copy
import json

from fastapi.testclient import TestClient

from api.app import create_app
from planner.formats import Profile, digest
from tests.api.conftest import make_settings, profile_doc


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200
    assert r.json() == {"status": "ok", "workers": 2, "running": 0, "queued": 0, "capacity": 18}


def test_store_read_and_deduplicate(client: TestClient) -> None:
    doc = profile_doc()
    r = client.post("/v1/profiles", json=doc)
    assert r.status_code == 201, r.text
    created = r.json()
    assert created["sha256"] == digest(Profile.model_validate(doc))
    assert created["num_layers"] == 8 and created["created"] is True
    assert r.headers["location"] == f"/v1/profiles/{created['id']}"

    again = client.post("/v1/profiles", json=doc)
    assert again.status_code == 200 and again.json()["id"] == created["id"]
    assert again.json()["created"] is False

    got = client.get(f"/v1/profiles/{created['id']}").json()
    assert Profile.model_validate(got["profile"]) == Profile.model_validate(doc)


def test_paging(client: TestClient) -> None:
    ids = [client.post("/v1/profiles", json=profile_doc(n_layers=n)).json()["id"] for n in (2, 3, 4)]
    first = client.get("/v1/profiles", params={"limit": 2}).json()
    second = client.get("/v1/profiles", params={"limit": 2, "offset": 2}).json()
    assert first["total"] == second["total"] == 3
    assert [p["id"] for p in first["items"] + second["items"]] == ids
    assert client.get("/v1/profiles", params={"limit": 0}).status_code == 422
    assert client.get("/v1/profiles", params={"offset": -1}).status_code == 422


def test_unknown_profile_404(client: TestClient) -> None:
    r = client.get("/v1/profiles/nope")
    assert r.status_code == 404 and "nope" in r.json()["detail"]


def test_malformed_profile_names_the_field(client: TestClient) -> None:
    doc = profile_doc()
    doc["layers"][2]["fwd_ms"] = -1.0
    r = client.post("/v1/profiles", json=doc)
    assert r.status_code == 422
    [err] = r.json()["detail"]
    assert err["loc"] == ["body", "layers", 2, "fwd_ms"]
    assert "greater than or equal to 0" in err["msg"]

    dup = copy.deepcopy(profile_doc())
    dup["layers"][1]["name"] = "l0"
    r = client.post("/v1/profiles", json=dup)
    assert r.status_code == 422 and "'l0' appears twice" in r.text

    r = client.post("/v1/profiles", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid"

    r = client.post("/v1/profiles", content=json.dumps(profile_doc()), headers={"content-type": "text/plain"})
    assert r.status_code == 422 and "Content-Type: application/json" in r.json()["detail"][0]["msg"]
    # no content type at all: said so (validation said only "a valid dictionary" before)
    r = client.post("/v1/profiles", content=json.dumps(profile_doc()), headers={"content-type": ""})
    assert r.status_code == 422 and "without a Content-Type" in r.json()["detail"][0]["msg"]


def test_body_over_limit_413(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path, max_body_bytes=2_000))) as c:
        small = profile_doc(n_layers=2)
        assert c.post("/v1/profiles", json=small).status_code == 201
        big = profile_doc(n_layers=40)
        r = c.post("/v1/profiles", json=big)  # declared Content-Length over the limit
        assert r.status_code == 413 and "2000 bytes" in r.json()["detail"]

        import json

        data = json.dumps(big).encode()

        def chunks():  # no Content-Length: the streamed size is counted
            for i in range(0, len(data), 500):
                yield data[i:i + 500]

        r = c.post("/v1/profiles", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert c.get("/v1/profiles").json()["total"] == 1


def test_api_key(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path, api_key="s3cret"))) as c:
        assert c.get("/healthz").status_code == 200
        for method, path in [("get", "/v1/profiles"), ("get", "/v1/plans"), ("get", "/v1/jobs/x"),
                             ("post", "/v1/plans"), ("get", "/v1/plans/x/timeline.svg")]:
            r = c.request(method, path)
            assert r.status_code == 401, (method, path)
            assert r.headers["www-authenticate"] == "Bearer"
        wrong = c.get("/v1/profiles", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        basic = c.get("/v1/profiles", headers={"Authorization": "Basic czNjcmV0"})
        assert basic.status_code == 401
        ok = c.get("/v1/profiles", headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        # the docs page and the schema open in a browser without the key (they hold no data);
        # the schema says which routes need it
        schema = c.get("/openapi.json")
        assert schema.status_code == 200 and "/v1/plans" in schema.json()["paths"]
        op = schema.json()["paths"]["/v1/profiles"]["get"]
        assert op["security"] == [{"HTTPBearer": []}] and "401" in op["responses"]
        assert "security" not in schema.json()["paths"]["/healthz"]["get"]
        assert c.get("/docs").status_code == 200


def test_several_api_keys_each_a_client(tmp_path) -> None:
    with TestClient(create_app(make_settings(tmp_path, api_keys="alice:k-a,bob:k-b",
                                             quota_requests_per_minute=3))) as c:
        alice = {"Authorization": "Bearer k-a"}
        bob = {"Authorization": "Bearer k-b"}
        assert [c.get("/v1/profiles", headers=alice).status_code for _ in range(3)] == [200] * 3
        over = c.get("/v1/profiles", headers=alice)  # alice's 4th request within the minute
        assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
        assert "alice" in over.json()["detail"] and over.json()["request_id"]
        assert c.get("/v1/profiles", headers=bob).status_code == 200  # bob has his own quota
        assert c.get("/v1/profiles", headers={"Authorization": "Bearer k-c"}).status_code == 401
