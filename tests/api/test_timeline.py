"""Timelines of large schedules are readable pictures: a 16k-event and a 128-rank plan, drawn by
the server's render pool, show work (forward or backward colour) in every rank's row; the
rows are found in the PNG from the colours alone, not from the renderer's layout."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.timeline import COLORS, IDLE
from planner.formats import Plan
from planner.simulator import simulate
from tests.api.conftest import cluster_doc, profile_doc


def rgb(hex_colour: str) -> np.ndarray:
    return np.array([int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)], dtype=float)


def near(image: np.ndarray, colour: str, tol: float = 12.0) -> np.ndarray:
    return np.abs(image - rgb(colour)).max(axis=-1) <= tol


def manual_plan(client: TestClient, n_layers: int, split: list[int], nodes: int, per_node: int,
                microbatches: int) -> dict:
    body = {"profile": profile_doc(n_layers=n_layers, param_bytes=10_000_000),
            "cluster": cluster_doc(nodes=nodes, per_node=per_node),
            "options": {"method": "manual", "split": split, "global_batch": 8 * microbatches,
                        "microbatch_size": 8, "time_limit_s": 2.0}}
    r = client.post("/v1/plans", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def rank_rows_with_work(png: bytes, ranks: int) -> list[bool]:
    import matplotlib.image

    image = matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3] * 255.0
    work = near(image, COLORS["F"]) | near(image, COLORS["B"])
    chart = work | near(image, IDLE)
    rows = np.flatnonzero(chart.sum(axis=1) > chart.shape[1] * 0.3)  # the plot's rows of pixels
    top, bottom = rows.min(), rows.max() + 1
    band = (bottom - top) / ranks
    out = []
    for r in range(ranks):
        lo, hi = int(top + (r + 0.25) * band), int(top + (r + 0.75) * band) + 1
        out.append(bool(work[lo:hi].sum() >= 10))
    return out


@pytest.mark.parametrize(("name", "n_layers", "split", "nodes", "per_node", "microbatches"), [
    ("16k events, 8 ranks", 64, [8] * 8, 1, 8, 1000),
    ("128 ranks", 256, [2] * 128, 16, 8, 64),
])
def test_large_timelines_show_every_rank(client: TestClient, name: str, n_layers: int, split: list[int],
                                         nodes: int, per_node: int, microbatches: int) -> None:
    out = manual_plan(client, n_layers, split, nodes, per_node, microbatches)
    plan = Plan.model_validate(out["plan"])
    sim = simulate(plan)
    ranks = len({e.rank for e in sim.events})
    assert ranks == len(split) and len(sim.events) >= 2 * len(split) * microbatches
    r = client.get(out["links"]["timeline_png"])
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text[:200]
    rows = rank_rows_with_work(r.content, ranks)
    assert all(rows), f"{name}: ranks without coloured pixels: {[i for i, ok in enumerate(rows) if not ok]}"
    svg = client.get(out["links"]["timeline_svg"])
    assert svg.status_code == 200 and b"aggregated per pixel" in svg.content


def test_tiny_bars_do_not_vanish(client: TestClient) -> None:
    """A schedule whose bars are far narrower than a pixel is not a blank (idle) picture."""
    out = manual_plan(client, 16, [4] * 4, 1, 4, 2000)
    import matplotlib.image

    image = matplotlib.image.imread(io.BytesIO(client.get(out["links"]["timeline_png"]).content),
                                    format="png")[..., :3] * 255.0
    work = (near(image, COLORS["F"]) | near(image, COLORS["B"])).sum()
    idle = near(image, IDLE).sum()
    assert work > 5 * idle  # a 1F1B pipeline with 2000 microbatches is busy almost all the time


def test_a_drawing_past_the_render_timeout_is_a_504_that_says_what_to_do(tmp_path) -> None:
    """The render pool's deadline (PIPEPLAN_RENDER_TIMEOUT_S) is a server limit, as a solve's
    is: 504 with what to do, not 500 ("a bug in the server", as it was)."""
    from api.app import create_app
    from tests.api.conftest import make_settings

    with TestClient(create_app(make_settings(tmp_path, render_timeout_s=0.05))) as c:
        plan = manual_plan(c, 64, [4] * 16, 1, 16, 2048)
        r = c.get(f"/v1/plans/{plan['id']}/timeline.png")
        assert r.status_code == 504, r.text[:300]
        assert "PIPEPLAN_RENDER_TIMEOUT_S" in r.json()["detail"] and plan["id"] in r.json()["detail"]
        # what it says to do works: the stored plan's `plan` field is a plan simulate reads
        from planner.cli import main

        saved = tmp_path / "plan.json"
        saved.write_text(json.dumps(c.get(f"/v1/plans/{plan['id']}").json()["plan"]))
        assert "save its `plan` field as plan.json" in r.json()["detail"]
        assert main(["simulate", str(saved)]) == 0
