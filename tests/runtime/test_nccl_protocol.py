"""The batched point-to-point protocol NCCL uses (runtime.comm, `batched=True`), run on gloo:
the same results as single-device training, and plans the static order check refuses are
refused before training starts. On a machine with GPUs the real NCCL run is the last test."""

from __future__ import annotations

import json
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


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 4,
                    reason="needs 4 CUDA devices (NCCL)")
def test_nccl_replicas_clipping_and_resume_equal_single_device(run, tmp_path, monkeypatch):
    """What the 2-GPU run leaves out: the gradient all-reduce of a replicated stage (a group
    split from the default one), --clip-grad-norm's all-reduce over every rank, the
    checkpoint's gather of 4 parts and a --resume from it, all on NCCL."""
    monkeypatch.delenv("PIPEPLAN_P2P_BATCHED", raising=False)
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 3, [1, 2, 1], global_batch=12, microbatch_size=2)
    common = ("--model", model, "--optimizer", "sgd", "--clip-grad-norm", 0.05, "--timeout", 60)
    rc, _, err, _ = run(plan, *common, "--steps", 1, "--save", tmp_path / "ck")
    assert rc == 0, err
    rc, _, err, _ = run(plan, *common, "--steps", 1, "--resume", tmp_path / "ck",
                        "--save", tmp_path / "ck2")
    assert rc == 0, err
    ref = reference_train(str(model), 2, optimizer="sgd", global_batch=12, microbatch_size=2,
                          clip_grad_norm=0.05)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck2" / "model.pt")) < 1e-4


def _runtime_batches(path, stage_of, last):
    """A rank's logged batches (runtime.comm, PIPEPLAN_P2P_LOG) in planner.p2p_order's terms:
    one message per stage pair, microbatch and direction; headers left out."""
    from planner.p2p_order import Message, Op

    data = json.loads(path.read_text())
    rank = int(path.stem[4:])
    k = data["num_keys"]
    out = []
    for batch in data["batches"]:
        ops = set()
        for send, peer, tag in batch:
            header, grad, rest = tag % 2, (tag // 2) % 2, tag // 4
            if header:
                continue
            mb = rest // k
            me, other = stage_of[rank], stage_of[peer]
            backward = (other < me) if send else (other > me)
            if not grad and backward:  # the loss, from a last-stage rank to rank 0
                msg = Message("loss", last, -1, rank if send else peer)
            elif send:
                msg = Message("grad" if grad else "act", me, other, mb)
            else:
                msg = Message("grad" if grad else "act", other, me, mb)
            ops.add(Op(bool(send), peer, msg))
        if ops:
            out.append(ops)
    return out


@pytest.mark.parametrize("case", ["1f1b-replicas", "gpipe-dag", "1f1b-tp", "zb-h1"])
def test_runtime_issues_exactly_what_the_static_check_models(run, tmp_path, batched, monkeypatch, case):
    """The order planner.p2p_order proves safe is the order the runtime really issues (also
    from and to every TP rank of a tensor-parallel stage)."""
    from planner.p2p_order import rank_programs
    from planner.runnable import runnable_plan
    from planner.schedules import plan_actions

    monkeypatch.setenv("PIPEPLAN_P2P_LOG", str(tmp_path))
    if case == "1f1b-replicas":
        model = MODELS / "seq_mlp.py"
        path = run.plan(model, 3, [1, 2, 1], global_batch=12, microbatch_size=2)
    elif case == "zb-h1":  # a W receives nothing: its B took the gradient
        model = MODELS / "seq_mlp.py"
        path = run.plan(model, 3, schedule="zb-h1", global_batch=12, microbatch_size=2)
    elif case == "1f1b-tp":
        for k, v in {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_HEADS": "4",
                     "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8", "PIPEPLAN_GPT_TIED": "0"}.items():
            monkeypatch.setenv(k, v)
        model = EXAMPLES / "gpt.py"
        path = run.plan(model, [2, 2], [1, 1], tp=[1, 2], global_batch=8, microbatch_size=2)
    else:
        model = EXAMPLES / "unet.py"
        path = run.plan(model, 3, schedule="gpipe", global_batch=4, microbatch_size=1)
    steps = 3
    rc, _, err, _ = run(path, "--model", model, "--steps", steps, "--timeout", 60)
    assert rc == 0, err
    plan = runnable_plan(load_model(path, Plan, "plan"))
    stage_devices = [list(s.devices) for s in plan.stages]
    stage_of = {d: s for s, devs in enumerate(stage_devices) for d in devs}
    # the stage pairs the model's tensors cross (as the worker gives them to the check)
    logged = [op for r in stage_of for b in _runtime_batches(tmp_path / f"rank{r}.json", stage_of, 2)
              for op in b]
    pairs = {(op.msg.src_stage, op.msg.dst_stage) for op in logged if op.msg.kind == "act"}
    if case == "gpipe-dag":
        assert (0, 2) in pairs  # the U-Net's skip crosses stage 1
    programs = rank_programs(plan_actions(plan), stage_devices, pairs,
                             tps=[s.tp for s in plan.stages])
    for rank, prog in programs.items():
        model_batches = [set(st.ops) for st in prog if st.what == "issue"]
        got = _runtime_batches(tmp_path / f"rank{rank}.json", stage_of, len(stage_devices) - 1)
        n = len(model_batches) * (steps - 1)  # the first step also sends shapes: compare the rest
        assert got[-n:] == model_batches * (steps - 1), f"rank {rank}"
