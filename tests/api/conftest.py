"""Fixtures for the service tests: small profiles built here, an app on a fresh SQLite file."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api.app import create_app
from api.settings import Settings
from planner.formats import Cluster, PlanOptions, Profile
from planner.solve import make_plan

INPUT = "<input>"


def profile_doc(n_layers: int = 8, fwd_ms: float = 1.0, param_bytes: int = 400_000_000,
                batch_size: int = 8, name: str = "tiny") -> dict[str, Any]:
    """A chain of n layers with uneven times (so partitioners have something to balance)."""
    layers = [{"name": f"l{i}", "fwd_ms": fwd_ms * (1 + i % 3), "bwd_ms": 2 * fwd_ms * (1 + i % 3),
               "param_bytes": param_bytes, "activation_bytes": 200_000, "output_bytes": 50_000}
              for i in range(n_layers)]
    edges = [{"src": INPUT, "dst": "l0", "bytes": 10_000}]
    edges += [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 50_000} for i in range(n_layers - 1)]
    return {"schema_version": 1, "model": {"path": f"{name}.py", "sha256": "0" * 64},
            "device": {"type": "cpu", "name": "test-cpu"}, "batch_size": batch_size,
            "layers": layers, "edges": edges}


def cluster_doc(nodes: int = 1, per_node: int = 4, memory_gb: float = 16.0) -> dict[str, Any]:
    return {"nodes": nodes, "devices_per_node": per_node, "device_memory_gb": memory_gb,
            "intra_node_gb_per_s": 100.0, "inter_node_gb_per_s": 10.0}


def plan_body(method: str = "blocks", global_batch: int = 32, **kw: Any) -> dict[str, Any]:
    body = {"profile": profile_doc(), "cluster": cluster_doc(),
            "options": {"method": method, "global_batch": global_batch, "time_limit_s": 2.0}}
    body.update(kw)
    return body


def slow_body(time_limit_s: float = 20.0) -> dict[str, Any]:
    """A request that keeps a worker busy for its whole time limit: CP-SAT on 200 uneven layers
    (seeded) and 4 x 8 devices, which it does not prove optimal quickly (~3 % gap after 8 s)."""
    rng = random.Random(7)
    profile = profile_doc(n_layers=200)
    for layer in profile["layers"]:
        fwd = rng.uniform(0.5, 3.0)
        layer.update(fwd_ms=fwd, bwd_ms=2 * fwd + rng.uniform(0.0, 1.0),
                     param_bytes=rng.randint(10_000_000, 300_000_000))
    body = plan_body("cpsat", profile=profile, cluster=cluster_doc(nodes=4, per_node=8))
    body["options"]["time_limit_s"] = time_limit_s
    return body


def make_settings(tmp_path: Path, **kw: Any) -> Settings:
    base: dict[str, Any] = {"db": str(tmp_path / "pipeplan.db"), "workers": 2, "queue_size": 16,
                            "sync_wait_s": 30.0, "max_time_limit_s": 5.0, "api_key": None}
    base.update(kw)
    return Settings(**base)


def direct(body: dict[str, Any]) -> dict[str, Any]:
    """The planner's own answer to a request body (the independent reference)."""
    plan = make_plan(Profile.model_validate(body["profile"]), Cluster.model_validate(body["cluster"]),
                     PlanOptions.model_validate(body["options"]))
    return plan.model_dump(mode="json")


def without_wall(plan: dict[str, Any]) -> dict[str, Any]:
    out = dict(plan)
    out["solver"] = {k: v for k, v in plan["solver"].items() if k != "wall_s"}
    return out


def wait_job(client: TestClient, job_id: str, timeout_s: float = 60.0) -> dict[str, Any]:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["status"] not in ("queued", "running"):
            return job
        time.sleep(0.05)
    raise AssertionError(f"job {job_id} still unfinished after {timeout_s} s")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return make_settings(tmp_path)


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c
