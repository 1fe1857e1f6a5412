"""Weight decay, gradient-norm clipping over every stage and learning-rate schedules train as
one process does with torch's own AdamW / SGD, clip_grad_norm_ and LambdaLR (real processes,
real gloo, CPU)."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from reference import max_abs_diff, reference_train
from runtime_paths import EXAMPLES, MODELS

TOL = 1e-5
GPT_ENV = {"PIPEPLAN_GPT_TIED": "1", "PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32",
           "PIPEPLAN_GPT_HEADS": "4", "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8"}


def cosine_with_warmup(warmup: int, total: int):
    """transformers' get_cosine_schedule_with_warmup (one half-cycle), written out here."""
    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        progress = (step - warmup) / max(1, total - warmup)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return f


def linear_with_warmup(warmup: int, total: int):
    """transformers' get_linear_schedule_with_warmup, written out here."""
    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup)
        return max(0.0, (total - step) / max(1, total - warmup))
    return f


def _norms(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"grad norm ([0-9.e+-]+)", out)]


def test_clipping_over_tied_and_replicated_stages_with_decay_and_cosine(run, tmp_path, monkeypatch):
    # the tied embedding is held by stages 0 and 2 and stage 1 has two replicas: each gradient
    # must enter the norm once
    for k, v in GPT_ENV.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    plan = run.plan(model, 3, [1, 2, 1], global_batch=8, microbatch_size=2)
    rc, out, err, _ = run(plan, "--model", model, "--steps", 4, "--optimizer", "momentum",
                          "--lr", 0.05, "--weight-decay", 0.1, "--clip-grad-norm", 0.5,
                          "--lr-schedule", "cosine", "--warmup-steps", 1, "--decay-steps", 5,
                          "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    norms: list[float] = []
    ref = reference_train(str(model), 4, optimizer="momentum", lr=0.05, weight_decay=0.1,
                          clip_grad_norm=0.5, lr_lambda=cosine_with_warmup(1, 5), norms=norms)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL
    # the norm each step printed is the whole model's before clipping, as one process's
    assert min(norms) > 0.5 and _norms(out) == pytest.approx(norms, rel=1e-3)
    assert "gradient norm clipped to 0.5" in out and "cosine decay to 0 at step 5" in out


def test_adamw_clipping_and_a_linear_schedule_resume_like_one_run(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, [2, 1], global_batch=12, microbatch_size=2)
    common = ["--model", model, "--timeout", 60]
    rc, out, err, _ = run(plan, *common, "--steps", 2, "--optimizer", "adam", "--lr", 0.01,
                          "--weight-decay", 0.05, "--clip-grad-norm", 0.05,
                          "--lr-schedule", "linear", "--warmup-steps", 2, "--decay-steps", 6,
                          "--save", tmp_path / "a")
    assert rc == 0, err
    # everything but the steps comes from the checkpoint
    rc, out2, err, _ = run(plan, *common, "--steps", 3, "--resume", tmp_path / "a",
                           "--save", tmp_path / "b")
    assert rc == 0, err
    assert "AdamW" in out2 and "linear decay to 0 at step 6" in out2
    norms: list[float] = []
    ref = reference_train(str(model), 5, optimizer="adam", lr=0.01, weight_decay=0.05,
                          clip_grad_norm=0.05, lr_lambda=linear_with_warmup(2, 6),
                          global_batch=12, microbatch_size=2, norms=norms)
    assert max_abs_diff(ref, torch.load(tmp_path / "b" / "model.pt")) < TOL
    assert min(norms) > 0.05 and _norms(out) + _norms(out2) == pytest.approx(norms, rel=1e-3)
    meta = json.loads((tmp_path / "b" / "meta.json").read_text())
    assert (meta["weight_decay"], meta["clip_grad_norm"], meta["lr_schedule"],
            meta["warmup_steps"], meta["decay_steps"], meta["step"]) == (0.05, 0.05, "linear", 2, 6, 5)


def test_clipping_a_tensor_parallel_stage_counts_each_shard_once(run, tmp_path, monkeypatch):
    for k, v in {**GPT_ENV, "PIPEPLAN_GPT_TIED": "0"}.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    plan = run.plan(model, [2, 2], [1, 1], tp=[2, 1], global_batch=8, microbatch_size=2)
    rc, out, err, _ = run(plan, "--model", model, "--steps", 3, "--clip-grad-norm", 0.3,
                          "--lr", 0.5, "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    norms: list[float] = []
    ref = reference_train(str(model), 3, clip_grad_norm=0.3, lr=0.5, norms=norms)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL
    assert min(norms) > 0.3 and _norms(out) == pytest.approx(norms, rel=1e-3)


def test_clipping_bfloat16_parameters_computes_the_factor_in_bfloat16(run, tmp_path):
    # clip_grad_norm_ takes each norm, the total and the factor in the gradients' dtype: a sum
    # of squares in float64 gave another factor (2.776 against 2.766) and weights a bfloat16
    # step apart
    model = MODELS / "bf16_blocks.py"
    plan = run.plan(model, [2, 3], global_batch=8, microbatch_size=2)
    rc, out, err, _ = run(plan, "--model", model, "--steps", 3, "--lr", 0.05, "--optimizer", "momentum",
                          "--clip-grad-norm", 0.2, "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    norms: list[float] = []
    ref = reference_train(str(model), 3, optimizer="momentum", lr=0.05, clip_grad_norm=0.2, norms=norms)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) == 0.0
    assert _norms(out) == pytest.approx(norms, rel=1e-3)


@pytest.mark.parametrize(("args", "said"), [
    (["--clip-grad-norm", "-1"], "--clip-grad-norm -1: give the largest gradient norm"),
    (["--steps", "10000000000000"], "--steps 10000000000000: give from 1 to"),
    (["--clip-grad-norm", "nan"], "--clip-grad-norm nan"),
    (["--weight-decay", "-1"], "--weight-decay -1: give a weight decay"),
    (["--warmup-steps", "-2"], "--warmup-steps -2"),
    (["--lr-schedule", "cosine", "--warmup-steps", "5", "--decay-steps", "5"],
     "--decay-steps 5: a cosine schedule falls to 0 after its 5 warm-up steps"),
])
def test_a_bad_training_rule_is_refused_before_any_rank_starts(run, tmp_path, args, said):
    plan = run.plan(MODELS / "seq_mlp.py", 2)
    rc, out, err, _ = run(plan, "--model", MODELS / "seq_mlp.py", "--steps", 2, *args)
    assert rc == 2 and "running" not in out and said in err and "Traceback" not in err


def test_a_schedule_that_ends_before_the_run_is_warned_about(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 1)
    rc, out, err, _ = run(plan, "--model", model, "--steps", 3, "--lr-schedule", "linear",
                          "--decay-steps", 2, "--timeout", 60)
    assert rc == 0, err
    assert "reaches a learning rate of 0 at step 2, before this run's last step (3)" in err
    assert [float(x) for x in re.findall(r"  lr ([0-9.e+-]+)", out)] == [0.01, 0.005, 0.0]


def test_save_every_keeps_the_last_checkpoint_of_a_run_that_failed_later(run, tmp_path, monkeypatch):
    # make_batch fails on the ranks at their 4th call, step 4's batch: the checkpoint of step 2
    # is there, and resuming from it trains like one uninterrupted run
    model = tmp_path / "model.py"
    model.write_text(f"""import os, sys
sys.path.insert(0, {str(MODELS)!r})
from seq_mlp import build_model, loss_fn
from seq_mlp import make_batch as _make_batch

calls = 0


def make_batch(n):
    global calls
    calls += 1
    if "RANK" in os.environ and os.environ.get("FAIL_AT_CALL") == str(calls):
        raise RuntimeError("the data loader broke")
    return _make_batch(n)
""")
    plan = run.plan(model, 2, [2, 1], global_batch=12, microbatch_size=2)
    common = ["--model", model, "--timeout", 60, "--optimizer", "adam", "--clip-grad-norm", 0.05]
    rc, out, err, _ = run(plan, *common, "--steps", 3, "--save-every", 0, "--save", tmp_path / "x")
    assert rc == 2 and "--save-every 0: give a number of steps" in err
    monkeypatch.setenv("FAIL_AT_CALL", "4")
    rc, out, err, _ = run(plan, *common, "--steps", 5, "--save", tmp_path / "ck", "--save-every", 2)
    monkeypatch.delenv("FAIL_AT_CALL")
    assert rc != 0 and "the data loader broke" in err
    assert "step 2: checkpoint saved" in out and "step 4:" not in out
    assert json.loads((tmp_path / "ck" / "meta.json").read_text())["step"] == 2
    rc, out, err, _ = run(plan, "--model", model, "--timeout", 60, "--steps", 3,
                          "--resume", tmp_path / "ck", "--save", tmp_path / "ck", "--save-every", 2)
    assert rc == 0, err
    assert "step 4: checkpoint saved" in out  # global steps, and the last one by the end of the run
    assert json.loads((tmp_path / "ck" / "meta.json").read_text())["step"] == 5
    ref = reference_train(str(model), 5, optimizer="adam", clip_grad_norm=0.05,
                          global_batch=12, microbatch_size=2)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL


def test_a_checkpoints_rule_is_kept_overridden_or_turned_off_and_its_errors_say_whose() -> None:
    import argparse

    from planner.errors import PipeplanError
    from runtime.cli import _training_rule

    def args(**kw: object) -> argparse.Namespace:
        base = dict(steps=3, weight_decay=None, clip_grad_norm=None, lr_schedule=None,
                    warmup_steps=None, decay_steps=None)
        return argparse.Namespace(**{**base, **kw})

    meta = {"step": 4, "weight_decay": 0.1, "clip_grad_norm": 1.0, "lr_schedule": "cosine",
            "warmup_steps": 2, "decay_steps": 10}
    assert _training_rule(args(), meta) == {"weight_decay": 0.1, "clip_grad_norm": 1.0,
                                            "lr_schedule": "cosine", "warmup_steps": 2, "decay_steps": 10}
    off = _training_rule(args(clip_grad_norm=0.0, weight_decay=0.0, lr_schedule="constant"), meta)
    assert off["clip_grad_norm"] is None and off["weight_decay"] == 0.0
    assert _training_rule(args(), {"step": 4})["decay_steps"] == 7  # this run's last step
    with pytest.raises(PipeplanError, match=r"--decay-steps \(the checkpoint's\) 10: .* 12 warm-up "
                                            r"steps \(--warmup-steps\)"):
        _training_rule(args(warmup_steps=12), meta)
