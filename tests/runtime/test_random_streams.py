"""Random numbers in a pipeline (runtime/rng.py): every (stage, microbatch) forward draws from
its own stream, so dropout masks are uncorrelated across stages and microbatches; one seed gives
identical weights run after run, whatever the number of replicas."""

from __future__ import annotations

import itertools

import torch
from reference import max_abs_diff
from runtime_paths import MODELS

MODEL = MODELS / "dropout_probe.py"


def _train(run, tmp, plan, name, *extra):
    rc, _, err, _ = run(plan, "--model", MODEL, "--steps", 2, "--save", tmp / name, "--timeout", 60,
                        *extra)
    assert rc == 0, err
    return torch.load(tmp / name / "model.pt")


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.corrcoef(torch.stack([a, b]))[0, 1])


def test_masks_independent_and_runs_reproducible(run, tmp_path):
    plan = run.plan(MODEL, [2, 2], global_batch=8, microbatch_size=2)  # inp+blocks.0 | blocks.1+out
    got = _train(run, tmp_path, plan, "a")
    m0, m1 = got["blocks.0.masks"][:8], got["blocks.1.masks"][:8]  # 2 steps x 4 microbatches
    assert int(got["blocks.0.calls"]) == int(got["blocks.1.calls"]) == 8
    assert all(0.3 < float(m.mean()) < 0.7 for m in (*m0, *m1))  # real masks were recorded
    # stage 0 against stage 1, same step and microbatch (was 1.000 with one shared seed)
    assert max(abs(_corr(m0[i], m1[i])) for i in range(8)) < 0.35
    # microbatches and steps against each other, within a stage
    for m in (m0, m1):
        assert max(abs(_corr(m[i], m[j])) for i, j in itertools.combinations(range(8), 2)) < 0.35
    # same plan, same seed: identical weights and masks
    again = _train(run, tmp_path, plan, "b")
    assert all(torch.equal(got[k], again[k]) for k in got)
    # another seed: other masks
    other = _train(run, tmp_path, plan, "c", "--seed", 1)
    assert not torch.equal(other["blocks.0.masks"], got["blocks.0.masks"])


def test_replicas_draw_the_masks_of_their_microbatches(run, tmp_path):
    # a microbatch's stream depends on (seed, step, stage, microbatch), not on which replica
    # runs it: replicating stage 0 changes the weights only by the gradients' summation order
    single = _train(run, tmp_path, run.plan(MODEL, [2, 2], name="p1.json"), "one")
    replicated = _train(run, tmp_path, run.plan(MODEL, [2, 2], [2, 1], name="p2.json"), "two")
    weights = [k for k in single if not k.endswith((".masks", ".calls"))]
    assert max_abs_diff({k: single[k] for k in weights}, {k: replicated[k] for k in weights}) < 1e-5


def test_resume_continues_the_same_streams(run, tmp_path):
    plan = run.plan(MODEL, [2, 2])
    straight = _train(run, tmp_path, plan, "straight")  # steps 1-2 in one run
    rc, _, err, _ = run(plan, "--model", MODEL, "--steps", 1, "--save", tmp_path / "half",
                        "--timeout", 60)
    assert rc == 0, err
    rc, _, err, _ = run(plan, "--model", MODEL, "--steps", 1, "--resume", tmp_path / "half",
                        "--save", tmp_path / "resumed", "--timeout", 60)
    assert rc == 0, err
    resumed = torch.load(tmp_path / "resumed" / "model.pt")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


def test_seed_forward_seeds_the_cpu_stream_as_manual_seed_does():
    """seed_forward sets the CPU generator exactly as torch.manual_seed(stream_seed(...)) would
    (it only skips the lazy seeds of uninitialised accelerator backends)."""
    from runtime.rng import seed_forward, stream_seed

    torch.manual_seed(stream_seed(0, 3, 1, 5))
    want = torch.rand(16)
    torch.manual_seed(123)  # some other state first
    seed_forward(0, 3, 1, 5)
    assert torch.equal(torch.rand(16), want)
