"""Memory the runtime measures equals what the planner predicted: parameters, gradients,
optimizer state and the saved activations of the microbatches in flight (the loss's included),
for a plan the planner made from a real profile."""

from __future__ import annotations

import json

import pytest
from runtime_paths import EXAMPLES

from planner.formats import Cluster, PlanOptions
from planner.io import save_model
from planner.solve import make_plan
from profiler.profile import profile_model_file

GPT_SMALL = {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "512",
             "PIPEPLAN_GPT_SEQ": "16"}


def test_measured_memory_equals_predicted(run, tmp_path, monkeypatch):
    for k, v in GPT_SMALL.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    profile = profile_model_file(model, batch_size=4, warmup=0, repeats=1)
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 3, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    options = PlanOptions(global_batch=8, microbatch_size=2, method="manual", split=[2, 2],
                          replicas=[2, 1], optimizer="adam")
    plan = make_plan(profile, cluster, options)
    path = tmp_path / "plan.json"
    save_model(plan, path)
    rc, _, err, _ = run(path, "--model", model, "--steps", 2, "--optimizer", "adam",
                        "--report", tmp_path / "report.json", "--timeout", 60)
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    for rank in report["ranks"]:
        predicted = plan.stages[rank["stage"]].predicted.memory_bytes
        assert rank["peak_memory_bytes"] == pytest.approx(predicted, rel=0.02), rank
