"""Memory the runtime measures equals what the planner predicted: parameters, gradients,
optimizer state and the saved activations of the microbatches in flight (the loss's included),
and during the last stage's backward the loss's working memory, for a plan the planner made
from a real profile."""

from __future__ import annotations

import json

import pytest
from runtime_paths import EXAMPLES

from planner.formats import Cluster, PlanOptions
from planner.io import save_model
from planner.solve import make_plan
from profiler.profile import profile_model_file


def _runs_as_predicted(run, tmp_path, plan, model) -> None:
    """Two Adam steps of `plan`: every rank's measured peak memory within 2 % of its stage's
    predicted memory."""
    path = tmp_path / "plan.json"
    save_model(plan, path)
    rc, _, err, _ = run(path, "--model", model, "--steps", 2, "--optimizer", "adam",
                        "--report", tmp_path / "report.json", "--timeout", 60)
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    for rank in report["ranks"]:
        predicted = plan.stages[rank["stage"]].predicted.memory_bytes
        assert rank["peak_memory_bytes"] == pytest.approx(predicted, rel=0.02), rank


GPT_SMALL = {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "512",
             "PIPEPLAN_GPT_SEQ": "16"}


# a vocabulary large enough that the last stage's memory is mostly the logits' (the loss
# saves log-probabilities the size of the logits, its backward allocates two more)
LARGE_VOCAB = {**GPT_SMALL, "PIPEPLAN_GPT_VOCAB": "4096"}


@pytest.mark.parametrize("sizes,schedule,recompute", [
    (GPT_SMALL, "1f1b", None),
    (LARGE_VOCAB, "1f1b", None),
    (LARGE_VOCAB, "zb-h1", [False, True]),
], ids=["gpt", "large-vocab", "large-vocab-zb-recompute"])
def test_measured_memory_equals_predicted(run, tmp_path, monkeypatch, sizes, schedule, recompute):
    for k, v in sizes.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    profile = profile_model_file(model, batch_size=4, warmup=0, repeats=1)
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 3, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    options = PlanOptions(global_batch=8, microbatch_size=2, method="manual", split=[2, 2],
                          replicas=[2, 1], optimizer="adam", schedule=schedule, recompute=recompute)
    plan = make_plan(profile, cluster, options)
    last = plan.stages[-1].predicted
    logits = 2 * 16 * int(sizes["PIPEPLAN_GPT_VOCAB"]) * 4  # microbatch 2, sequence 16, float32
    if sizes is LARGE_VOCAB:  # the loss's backward: two tensors the size of the logits
        ws = profile.measured.loss_workspace_bytes / 2  # profiled at batch 4
        assert ws == pytest.approx(2 * logits, rel=0.01)
        assert getattr(last, "loss_transient_bytes", 0) + getattr(last, "transient_bytes", 0) \
            == pytest.approx(ws, rel=1e-9)
    _runs_as_predicted(run, tmp_path, plan, model)


def test_buffers_are_held_once_per_device_and_predicted(run, tmp_path) -> None:
    """A model whose buffers (lookup tables, BatchNorm statistics) outweigh its parameters: the
    plan counts each stage's buffers once per device (no gradient, optimizer state or
    all-reduce), the plan's parameter bytes leave them out, and every rank measures what was
    predicted."""
    from runtime_paths import MODELS

    model = MODELS / "buffered_mlp.py"
    profile = profile_model_file(model, batch_size=4, warmup=0, repeats=1)
    buffers = [x.buffer_bytes for x in profile.layers]
    assert sum(buffers) >= 10 * 65_536 * 4, buffers  # the tables: 256 KB x (1 + 2 + 3 + 4)
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 3, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    options = PlanOptions(global_batch=8, microbatch_size=2, method="manual", split=[2, 2],
                          replicas=[2, 1], optimizer="adam")
    plan = make_plan(profile, cluster, options)
    for st in plan.stages:
        held = sum(x.buffer_bytes for x in profile.layers if x.name in st.layers)
        params = sum(x.param_bytes for x in profile.layers if x.name in st.layers)
        assert st.param_bytes == params
        assert st.predicted.static_memory_bytes == pytest.approx(4 * params + held, rel=1e-9)
    _runs_as_predicted(run, tmp_path, plan, model)


@pytest.mark.parametrize("split", [[4], [2, 2]], ids=["one-stage", "two-stages"])
def test_a_tied_weight_is_held_once_per_stage_and_predicted(run, tmp_path, monkeypatch, split) -> None:
    """The GPT example with its embedding and head tied: one stage holds the shared matrix
    once (with one gradient and one Adam state), two stages each hold it. The planner counted
    it once per layer holding it: 2.1 MB more than measured on the example's default sizes."""
    for k, v in {**LARGE_VOCAB, "PIPEPLAN_GPT_TIED": "1"}.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    profile = profile_model_file(model, batch_size=4, warmup=0, repeats=1)
    tied = 4096 * 32 * 4  # vocabulary x width, float32
    assert [(e.bytes, e.frozen, e.buffer) for e in profile.shared_parameters or []] == [(tied, False, False)]
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    plan = make_plan(profile, cluster, PlanOptions(global_batch=8, microbatch_size=2, method="manual",
                                                   split=split, optimizer="adam"))
    per_layer = [sum(x.param_bytes for x in profile.layers if x.name in st.layers) for st in plan.stages]
    held = [st.param_bytes for st in plan.stages]
    assert held == ([per_layer[0] - tied] if len(split) == 1 else per_layer)
    _runs_as_predicted(run, tmp_path, plan, model)


def test_a_tensor_two_layers_save_is_kept_once_and_predicted(run, tmp_path) -> None:
    """Each Tanh saves its output and the next Linear saves it as its input: a stage holding
    both keeps it once, and the prediction (which counted it once per layer, 1.6x the measured
    activations here) matches every rank's measured peak."""
    from runtime_paths import MODELS

    model = MODELS / "tanh_chain.py"
    profile = profile_model_file(model, batch_size=4, warmup=0, repeats=1)
    assert len(profile.layers) == 7 and len(profile.shared_saved or []) == 3, profile.shared_saved
    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 2, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    plan = make_plan(profile, cluster, PlanOptions(global_batch=8, microbatch_size=2, method="manual",
                                                   split=[4, 3], optimizer="adam"))
    _runs_as_predicted(run, tmp_path, plan, model)
