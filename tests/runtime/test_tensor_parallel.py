"""Tensor-parallel stages (torch's parallelize_module over a per-replica mesh, gloo on CPU)
train exactly like single-process training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import max_abs_diff, reference_train
from runtime_paths import EXAMPLES

from profiler.loader import load_model_file

TOL = 1e-5
GPT_ENV = {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_HEADS": "4",
           "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8", "PIPEPLAN_GPT_TIED": "0"}


@pytest.fixture
def gpt(monkeypatch):
    for k, v in GPT_ENV.items():
        monkeypatch.setenv(k, v)
    return EXAMPLES / "gpt.py"


def _train(run, model, plan, tmp, steps=3, optimizer="sgd"):
    rc, out, err, _ = run(plan, "--model", model, "--steps", steps, "--optimizer", optimizer,
                          "--save", tmp / "ck", "--report", tmp / "report.json", "--timeout", 60)
    assert rc == 0, err
    got = torch.load(tmp / "ck" / "model.pt")
    load_model_file(model).build_model().load_state_dict(got)  # whole tensors, every key
    return got, json.loads((tmp / "report.json").read_text())


@pytest.mark.parametrize(("split", "replicas", "tp", "ranks"), [
    ([4], [1], [2], 2),  # 1 stage x TP 2
    ([2, 2], [1, 1], [2, 1], 3),  # 2 stages, TP 2 then 1
    ([4], [2], [2], 4),  # 1 stage, 2 replicas x TP 2
], ids=["1stage-tp2", "2stages-tp2-1", "2replicas-x-tp2"])
def test_gpt_tensor_parallel_equals_single_process(run, tmp_path, gpt, split, replicas, tp, ranks):
    plan = run.plan(gpt, split, replicas, tp=tp, global_batch=8, microbatch_size=2)
    got, report = _train(run, gpt, plan, tmp_path)
    assert len(report["ranks"]) == ranks
    ref = reference_train(str(gpt), 3)
    assert max_abs_diff(ref, got) < TOL
    if len(split) == 1:  # the weights really are sharded: a TP rank holds about half of them
        full = sum(p.numel() * 4 for p in load_model_file(gpt).build_model().parameters())
        for r in report["ranks"]:
            held = r["peak_memory_bytes"] - r["peak_activation_bytes"]  # params + grads (SGD)
            assert 0.5 * 2 * full <= held < 0.6 * 2 * full


def test_tp_plan_patterns_name_the_stage_modules(gpt):
    from runtime.tensor_parallel import model_tp_plan, resolve

    mf = load_model_file(gpt)
    model = mf.build_model()
    got = resolve(model_tp_plan(model, mf.tp_plan), model)
    assert got["blocks.1.attn.q"] == "colwise" and got["blocks.0.mlp.2"] == "rowwise"
    assert got["tok_emb"] == "embedding" and "pos_emb" not in got and "blocks.0.mlp.1" not in got


def test_tp_checkpoint_resumes_on_another_layout(run, tmp_path, gpt):
    # 2 steps on TP 2 (momentum: optimizer state is sharded too), saved whole; resumed for one
    # more step on 2 stages with TP 1 and 2: equal to 3 uninterrupted single-process steps
    a = run.plan(gpt, [4], [1], tp=[2], name="a.json")
    rc, _, err, _ = run(a, "--model", gpt, "--steps", 2, "--optimizer", "momentum",
                        "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    b = run.plan(gpt, [2, 2], [1, 1], tp=[1, 2], name="b.json")
    rc, _, err, _ = run(b, "--model", gpt, "--steps", 1, "--resume", tmp_path / "a",
                        "--save", tmp_path / "b", "--timeout", 60)
    assert rc == 0, err
    ref = reference_train(str(gpt), 3, optimizer="momentum")
    assert max_abs_diff(ref, torch.load(tmp_path / "b" / "model.pt")) < TOL


def test_transformers_llama_tp2_through_its_own_plan(run, tmp_path):
    # (transformers' GPT-2 has no TP plan: Conv1D layers; Llama ships base_model_tp_plan and
    # _tp_plan, used unchanged: q/k/v/gate/up colwise, o/down rowwise; its embedding and
    # lm_head are traced through (their weights read by the graph), so they stay whole)
    pytest.importorskip("transformers")
    from runtime_paths import MODELS

    model = MODELS / "hf_llama.py"
    plan = run.plan(model, [3, 3], [1, 1], tp=[2, 2])
    rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--optimizer", "sgd",
                        "--save", tmp_path / "ck", "--timeout", 120)
    assert rc == 0, err
    ref = reference_train(str(model), 3)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL


def test_profile_plan_run_tp_memory_matches_the_prediction(run, tmp_path, gpt):
    # the real commands: profile --tp 2, plan --method manual --tp 2,1, run; every TP rank's
    # measured peak memory (params + grads + saved activations) within 5 % of the plan's
    from runtime_paths import EXAMPLES as ex

    from planner.cli import main as planner_main

    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert planner_main(["profile", str(gpt), "--batch-size", "4", "--tp", "2", "--warmup", "0",
                         "--repeats", "1", "-q", "-o", str(prof)]) == 0
    assert planner_main(["plan", str(prof), "--cluster", str(ex / "cpu_cluster.json"),
                         "--method", "manual", "--split", "2,2", "--tp", "2,1", "--global-batch",
                         "8", "--microbatch-size", "2", "--optimizer", "sgd", "-o", str(plan)]) == 0
    got, report = _train(run, gpt, plan, tmp_path)
    assert max_abs_diff(reference_train(str(gpt), 3), got) < TOL
    predicted = json.loads(plan.read_text())["stages"][0]["predicted"]["memory_bytes"]
    tp_ranks = [r for r in report["ranks"] if r["stage"] == 0]
    assert len(tp_ranks) == 2
    for r in tp_ranks:
        assert abs(r["peak_memory_bytes"] / predicted - 1) < 0.05, (r["peak_memory_bytes"], predicted)


def test_tp_stages_under_the_batched_nccl_protocol(run, tmp_path, gpt, monkeypatch):
    # NCCL's protocol (an action's sends with the next action's receives, one batch), on gloo
    monkeypatch.setenv("PIPEPLAN_P2P_BATCHED", "1")
    plan = run.plan(gpt, [2, 2], [1, 1], tp=[2, 1])
    got, _ = _train(run, gpt, plan, tmp_path)
    assert max_abs_diff(reference_train(str(gpt), 3), got) < TOL


def test_a_stage_too_big_for_one_device_fits_with_tp(run, tmp_path, gpt):
    # device memory between what the stage needs sharded over 2 and what it needs whole:
    # --tp 1 does not fit, --tp 2 plans and runs exactly
    from planner.cli import main as planner_main

    prof = tmp_path / "p.json"
    assert planner_main(["profile", str(gpt), "--batch-size", "2", "--tp", "2", "--warmup", "0",
                         "--repeats", "1", "-q", "-o", str(prof)]) == 0

    def plan(tp: str, memory_gb: float, out: str, rc: int = 0) -> Path:
        cluster = tmp_path / f"c{out}.json"
        cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": 2, "device_memory_gb": memory_gb,
                                       "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1}))
        argv = ["plan", str(prof), "--cluster", str(cluster), "--method", "manual", "--split", "4",
                "--tp", tp, "--global-batch", "8", "--microbatch-size", "2", "--optimizer", "sgd",
                "-o", str(tmp_path / out)]
        assert planner_main(argv) == rc
        return tmp_path / out

    def need(path: Path) -> int:
        return json.loads(path.read_text())["stages"][0]["predicted"]["memory_bytes"]

    whole, sharded = need(plan("1", 1.0, "a.json")), need(plan("2", 1.0, "b.json"))
    assert sharded < 0.8 * whole
    limit_gb = (whole + sharded) / 2 / 1e9
    run.capfd.readouterr()
    plan("1", limit_gb, "c.json", rc=2)
    assert "does not fit in device memory" in run.capfd.readouterr().err
    fitting = plan("2", limit_gb, "d.json")
    got, _ = _train(run, gpt, fitting, tmp_path)
    assert max_abs_diff(reference_train(str(gpt), 3), got) < TOL


def test_too_big_for_one_device_gets_a_tp_plan_that_runs_exactly(run, tmp_path, gpt):
    """Devices with less memory than any plan without TP needs (but enough for a sharded one):
    `plan --max-tp 1` says it does not fit, `plan --max-tp 4` returns a plan with TP stages,
    and that plan trains exactly like one process."""
    import json as _json

    from planner.cli import main as planner_main
    from planner.errors import PipeplanError
    from planner.formats import Cluster, PlanOptions, Profile
    from planner.solve import make_plan

    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    assert planner_main(["profile", str(gpt), "--batch-size", "2", "--tp", "2", "--warmup", "0",
                         "--repeats", "1", "-q", "-o", str(prof)]) == 0
    profile = Profile.model_validate_json(prof.read_text())

    def cluster(gb: float) -> dict:
        return {"nodes": 1, "devices_per_node": 4, "device_memory_gb": gb,
                "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1}

    def least(max_tp: int) -> float:  # GB: the least memory the planner finds a plan in
        lo, hi = 1e-7, 1.0
        while hi / lo > 1.01:
            mid = (lo * hi) ** 0.5
            try:
                make_plan(profile, Cluster.model_validate(cluster(mid)),
                          PlanOptions(global_batch=8, microbatch_size=2, optimizer="sgd",
                                      time_limit_s=1, max_tp=max_tp, allow_recompute=False))
                hi = mid
            except PipeplanError:
                lo = mid
        return hi

    with_tp, without = least(4), least(1)
    assert with_tp < without  # sharding lowers the memory a plan needs
    path = tmp_path / "cluster.json"
    path.write_text(_json.dumps(cluster((with_tp * without) ** 0.5)))
    args = ["plan", str(prof), "--cluster", str(path), "--global-batch", "8", "--no-recompute",
            "--microbatch-size", "2", "--optimizer", "sgd", "--time-limit", "1", "-o", str(plan)]
    assert planner_main([*args, "--max-tp", "1"]) == 2  # a clear "does not fit"
    assert planner_main([*args, "--max-tp", "4"]) == 0
    assert any(s.get("tp", 1) == 2 for s in _json.loads(plan.read_text())["stages"])
    got, _ = _train(run, gpt, plan, tmp_path)
    assert max_abs_diff(reference_train(str(gpt), 3), got) < TOL


def test_a_weight_tied_across_stages_on_a_tp_stage_is_refused_before_any_rank_starts(run, tmp_path, gpt,
                                                                                    monkeypatch):
    # rank 1 failed in its first gradient sum (aten.cat of a Tensor and a DTensor), traceback
    monkeypatch.setenv("PIPEPLAN_GPT_TIED", "1")
    plan = run.plan(gpt, [2, 2], [1, 1], tp=[2, 1], global_batch=8, microbatch_size=2)
    rc, out, err, _ = run(plan, "--model", gpt, "--steps", 1, "--timeout", 60)
    assert rc == 2 and "tok_emb.weight is tied across stages 0, 1" in err and "tensor-parallel" in err, err
    assert "running" not in out and "Traceback" not in err


def test_the_planner_gives_no_tp_degree_to_a_stage_of_a_weight_tied_across_stages(tmp_path, gpt, monkeypatch):
    # the runtime refuses such a plan; the planner searched it (and the bound may still count it:
    # a relaxation). Devices too small for stage 0 whole leave TP on stages 0 and last the
    # tempting choice; every plan it gives must run
    import itertools

    from planner.cli import main as planner_main

    monkeypatch.setenv("PIPEPLAN_GPT_TIED", "1")
    prof, out = tmp_path / "p.json", tmp_path / "plan.json"
    assert planner_main(["profile", str(gpt), "--batch-size", "2", "--tp", "2", "--warmup", "0",
                         "--repeats", "1", "-q", "-o", str(prof)]) == 0
    tied = [e["layers"] for e in json.loads(prof.read_text()).get("shared_parameters") or []]
    assert tied, "the tied profile names its shared parameter"
    for gb, per in itertools.product((0.00012, 0.0002), (4,)):  # 120 kB: TP 2 on both ends was its plan
        cluster = tmp_path / "c.json"
        cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": per, "device_memory_gb": gb,
                                       "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1}))
        rc = planner_main(["plan", str(prof), "--cluster", str(cluster), "--global-batch", "8",
                           "--microbatch-size", "2", "--optimizer", "sgd", "--time-limit", "2", "-o", str(out)])
        if rc != 0:
            continue
        stages = json.loads(out.read_text())["stages"]
        where = {layer: k for k, st in enumerate(stages) for layer in st["layers"]}
        for layers in tied:
            holders = {where[x] for x in layers}
            assert len(holders) == 1 or all(stages[k].get("tp", 1) == 1 for k in holders), (gb, per, stages)
