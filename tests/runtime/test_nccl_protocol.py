"""The batched point-to-point protocol NCCL uses (runtime.comm, `batched=True`), run on gloo:
the same results as single-device training, and plans the static order check refuses are
refused before training starts. On a machine with GPUs the real NCCL run is the last test."""

from __future__ import annotations

import os

import pytest
import torch
from reference import max_abs_diff, reference_train
from runtime_paths import EXAMPLES, MODELS

from planner.actions import Action
from planner.formats import Plan
from planner.io import load_model, save_model

TOL = 1e-5


@pytest.fixture
def batched(monkeypatch):
    monkeypatch.setenv("PIPEPLAN_P2P_BATCHED", "1")


def _train(run, model, plan, tmp, steps=2, **ref_kw):
    rc, _, err, _ = run(plan, "--model", model, "--steps", steps, "--optimizer", "sgd",
                        "--save", tmp / "ck", "--timeout", 60)
    assert rc == 0, err
    ref = reference_train(str(model), steps, optimizer="sgd", **ref_kw)
    assert max_abs_diff(ref, torch.load(tmp / "ck" / "model.pt")) < TOL


def test_batched_1f1b_with_replicas_equals_single_device(run, tmp_path, batched):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 3, [1, 2, 1], global_batch=12, microbatch_size=2)
    _train(run, model, plan, tmp_path, global_batch=12, microbatch_size=2)


def test_batched_gpipe_dag_equals_single_device(run, tmp_path, batched):
    model = EXAMPLES / "unet.py"
    plan = run.plan(model, 3, schedule="gpipe", global_batch=4, microbatch_size=1)
    _train(run, model, plan, tmp_path, global_batch=4, microbatch_size=1)


def test_batched_refuses_a_reordered_plan_before_training(run, tmp_path, batched):
    model = MODELS / "seq_mlp.py"
    path = run.plan(model, 2, schedule="gpipe", global_batch=4, microbatch_size=2)
    plan = load_model(path, Plan, "plan")
    assert plan.rank_actions is not None
    plan.rank_actions["1"] = [str(a) for a in (Action(1, "F", 1), Action(1, "F", 0),
                                                Action(1, "B", 0), Action(1, "B", 1))]
    save_model(plan, path)
    rc, _, err, t = run(path, "--model", model, "--steps", 1, "--timeout", 60)
    assert rc == 2 and "different orders" in err and "rank 0 and rank 1" in err


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA devices (NCCL)")
def test_nccl_two_stages_equals_single_device(run, tmp_path, monkeypatch):
    monkeypatch.delenv("PIPEPLAN_P2P_BATCHED", raising=False)
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--optimizer", "sgd",
                        "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    ref = reference_train(str(model), 2, optimizer="sgd")
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < 1e-4
    assert os.environ.get("PIPEPLAN_P2P_BATCHED") is None
