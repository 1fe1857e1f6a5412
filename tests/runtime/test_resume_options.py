"""--resume continues with the checkpoint's optimizer, learning rate and seed unless told
otherwise, and refuses an optimizer whose state the checkpoint does not hold."""

from __future__ import annotations

import torch
from reference import max_abs_diff, reference_train
from runtime_paths import MODELS


def test_resume_takes_optimizer_lr_and_seed_from_the_checkpoint(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    rc, _, err, _ = run(plan, "--model", model, "--optimizer", "momentum", "--lr", 0.05,
                        "--seed", 3, "--steps", 1, "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a",
                        "--save", tmp_path / "b", "--timeout", 60)
    assert rc == 0, err
    ref = reference_train(str(model), 2, optimizer="momentum", lr=0.05, seed=3)
    assert max_abs_diff(ref, torch.load(tmp_path / "b" / "model.pt")) < 1e-5

    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a",
                        "--optimizer", "adam", "--timeout", 60)
    assert rc == 2 and "trained with momentum" in err and "Traceback" not in err
