"""Memory of zero-bubble (ZB-H1) and recomputed stages: each rank's peak, as the runtime counts
it (parameters, gradients, optimizer state, plus what the microbatches in flight hold: saved
activations, the gradients a split B keeps for its W, a recomputed block's activations while a
backward runs them), is within 5 % of the plan's prediction; and ZB-H1's peak stays within
1F1B's on the same split. Plans are made by the planner from a real profile (`--method
manual`), two stages, the runtime's ranks real processes."""

from __future__ import annotations

import json

import pytest
from runtime_paths import EXAMPLES

from planner.formats import Cluster, Plan, PlanOptions
from planner.io import save_model
from planner.solve import make_plan
from profiler.profile import profile_model_file

MODELS = {
    "gpt": ("gpt.py", {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "512",
                       "PIPEPLAN_GPT_SEQ": "16"}),
    "mlp": ("mlp.py", {"PIPEPLAN_MLP_BLOCKS": "2", "PIPEPLAN_MLP_DIM": "64"}),
}
# each runtime launch costs about 5 s (two processes starting torch): five launches in all,
# covering ZB-H1 with and without recomputation, recomputation under 1F1B, and ZB-H1 against
# 1F1B on the same split with and without it
CASES = {"gpt": [("1f1b", False), ("zb-h1", False), ("zb-h1", True)],
         "mlp": [("1f1b", True), ("zb-h1", True)]}


def _run(run, tmp_path, profile, model, schedule: str, recompute: list[bool]) -> tuple[Plan, dict[int, int]]:
    n = len(profile.layers)
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    options = PlanOptions(global_batch=8, microbatch_size=2, method="manual", split=[n // 2, n - n // 2],
                          replicas=[1, 1], schedule=schedule, recompute=recompute, optimizer="adam")
    plan = make_plan(profile, cluster, options)
    name = f"{schedule}-{''.join(str(int(x)) for x in recompute)}"
    path, report = tmp_path / f"{name}.json", tmp_path / f"{name}-report.json"
    save_model(plan, path)
    rc, _, err, _ = run(path, "--model", model, "--steps", 2, "--optimizer", "adam",
                        "--report", report, "--timeout", 60)
    assert rc == 0, err
    ranks = json.loads(report.read_text())["ranks"]
    return plan, {r["rank"]: r["peak_memory_bytes"] for r in ranks}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_zb_h1_and_recomputed_peak_memory_match_the_prediction(name, run, tmp_path, monkeypatch):
    file, env = MODELS[name]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / file
    profile = profile_model_file(model, batch_size=2, warmup=0, repeats=1)
    measured: dict[tuple[str, bool], dict[int, int]] = {}
    plans: dict[tuple[str, bool], Plan] = {}
    for schedule, rec in CASES[name]:
        plan, peaks = _run(run, tmp_path, profile, model, schedule, [rec, rec])
        assert [st.recompute for st in plan.stages] == [rec, rec]
        for st in plan.stages:
            rank = st.devices[0]
            assert peaks[rank] == pytest.approx(st.predicted.memory_bytes, rel=0.05), \
                (schedule, rec, rank, peaks[rank], st.predicted.memory_bytes)
        measured[(schedule, rec)], plans[(schedule, rec)] = peaks, plan
    if ("zb-h1", False) in measured:  # recomputation keeps less than the forward's activations
        assert max(measured[("zb-h1", True)].values()) < max(measured[("zb-h1", False)].values())
    # ZB-H1's peak over the ranks stays within 1F1B's, up to one microbatch's weight gradients
    # on one stage: a split backward keeps them from B until W (a fused backward frees each as
    # it goes, and the count of a 1F1B backward includes none of them)
    for rec in (False, True):
        if ("1f1b", rec) not in measured:
            continue
        zb = plans[("zb-h1", rec)]
        w_grads = max(float(st.predicted.weight_hold_bytes_per_microbatch)  # type: ignore[attr-defined]
                      - float(st.predicted.activation_bytes_per_microbatch)  # type: ignore[attr-defined]
                      for st in zb.stages)
        zb_peak, one_peak = max(measured[("zb-h1", rec)].values()), max(measured[("1f1b", rec)].values())
        assert zb_peak <= one_peak + max(w_grads, 0.0), (rec, zb_peak, one_peak, w_grads)


def test_planner_recomputes_where_nothing_else_fits_and_the_run_matches(run, tmp_path, monkeypatch):
    """GPT on 2 devices with memory just below what any plan without recomputation needs:
    `--no-recompute` does not fit, the default plan recomputes the stages that need it, and
    the run's per-rank peak memory is within 5 % of that plan's prediction."""
    from planner.errors import PipeplanError

    # long sequences, a small vocabulary, SGD: activations, not parameters, fill the memory
    for k, v in {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "64",
                 "PIPEPLAN_GPT_SEQ": "64"}.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    profile = profile_model_file(model, batch_size=2, warmup=0, repeats=1)

    def cluster(gb: float) -> Cluster:
        return Cluster.model_validate({"nodes": 1, "devices_per_node": 2, "device_memory_gb": gb,
                                       "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})

    options = PlanOptions(global_batch=8, microbatch_size=2, optimizer="sgd", time_limit_s=2)
    plain = options.model_copy(update={"allow_recompute": False})

    def fits(gb: float, opts: PlanOptions) -> bool:
        try:
            make_plan(profile, cluster(gb), opts)
        except PipeplanError:
            return False
        return True

    lo, hi = 1e-6, 1.0  # GB: the least memory any plan without recomputation fits in
    while hi / lo > 1.002:
        mid = (lo * hi) ** 0.5
        lo, hi = (lo, mid) if fits(mid, plain) else (mid, hi)
    tight = cluster(0.97 * hi)
    with pytest.raises(PipeplanError, match="fit"):
        make_plan(profile, tight, plain)
    plan = make_plan(profile, tight, options)
    assert plan.predicted.fits_memory and any(st.recompute for st in plan.stages)
    path, report = tmp_path / "plan.json", tmp_path / "report.json"
    save_model(plan, path)
    rc, _, err, _ = run(path, "--model", model, "--steps", 2, "--optimizer", "sgd",
                        "--report", report, "--timeout", 60)
    assert rc == 0, err
    peaks = {r["rank"]: r["peak_memory_bytes"] for r in json.loads(report.read_text())["ranks"]}
    for st in plan.stages:
        for rank in st.devices:
            assert peaks[rank] == pytest.approx(st.predicted.memory_bytes, rel=0.05), \
                (rank, peaks[rank], st.predicted.memory_bytes, st.recompute)
