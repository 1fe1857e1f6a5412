"""BatchNorm: a hand-written ResNet-18 trains on 2 stages with weights and running statistics
equal to single-process training; with a replicated stage every buffer of the checkpoint is
consistent (runtime/rng.py: integer buffers sum the replicas' increments, floating-point ones are
averaged)."""

from __future__ import annotations

import torch
from plans import traced_layers
from reference import max_abs_diff, reference_train
from runtime_paths import MODELS

MODEL = MODELS / "resnet18.py"


def _train(run, tmp, plan, steps):
    rc, _, err, _ = run(plan, "--model", MODEL, "--steps", steps, "--optimizer", "momentum",
                        "--save", tmp / "ck", "--timeout", 120)
    assert rc == 0, err
    return torch.load(tmp / "ck" / "model.pt")


def test_resnet18_layers_are_stem_blocks_head():
    layers = traced_layers(MODEL)
    assert layers[1:9] == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    assert len(layers) == 10


def test_resnet18_two_stages_running_statistics_exact(run, tmp_path):
    got = _train(run, tmp_path, run.plan(MODEL, 2), 2)
    ref = reference_train(str(MODEL), 2, optimizer="momentum")
    assert max_abs_diff(ref, got) < 1e-5  # weights, running_mean/var, num_batches_tracked
    assert all(int(v) == 8 for k, v in got.items() if k.endswith("num_batches_tracked"))


def test_resnet18_replicated_stage_buffers_consistent(run, tmp_path):
    got = _train(run, tmp_path, run.plan(MODEL, [4, 6], [2, 1]), 2)
    ref = reference_train(str(MODEL), 2, optimizer="momentum")
    # every stage counted every microbatch once: 2 steps x 4 microbatches, as single-process
    counts = {k: int(v) for k, v in got.items() if k.endswith("num_batches_tracked")}
    assert set(counts.values()) == {8}, counts
    weights = [k for k in ref if "running" not in k and "num_batches" not in k]
    assert max_abs_diff({k: ref[k] for k in weights}, {k: got[k] for k in weights}) < 1e-5
    # running statistics: the replicas' average, close to (not equal to) single-process's
    stats = [k for k in ref if "running" in k]
    assert max_abs_diff({k: ref[k] for k in stats}, {k: got[k] for k in stats}) < 0.5
