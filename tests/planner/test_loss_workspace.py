"""The loss's backward working memory: measured by the profiler, charged to the last stage's
B, and the prediction of a one-stage plan against the allocation peak of a plain training step
(torch.profiler's allocator events: an independent measure of the same step)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions
from planner.solve import make_plan
from profiler.allocations import peak_new_bytes
from profiler.loader import batch_checked, build_checked, load_model_file
from profiler.profile import profile_model_file

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
BATCH, SEQ, VOCAB = 4, 32, 6000
LARGE_VOCAB = {"PIPEPLAN_GPT_BLOCKS": "1", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_HEADS": "2",
               "PIPEPLAN_GPT_SEQ": str(SEQ), "PIPEPLAN_GPT_VOCAB": str(VOCAB)}
LOGITS = BATCH * SEQ * VOCAB * 4


@pytest.fixture(scope="module")
def profile():
    with pytest.MonkeyPatch.context() as mp:
        for k, v in LARGE_VOCAB.items():
            mp.setenv(k, v)
        yield profile_model_file(EXAMPLES / "gpt.py", batch_size=BATCH, warmup=0, repeats=1)


def _cluster(gb: float) -> Cluster:
    return Cluster.model_validate({"nodes": 1, "devices_per_node": 2, "device_memory_gb": gb,
                                   "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})


def _one_stage(profile, gb: float = 1.0):
    options = PlanOptions(global_batch=BATCH, microbatch_size=BATCH, method="manual",
                          split=[len(profile.layers)], replicas=[1], optimizer="sgd")
    return make_plan(profile, _cluster(gb), options)


def test_cross_entropy_backward_needs_two_logits(profile) -> None:
    m = profile.measured
    assert m.loss_activation_bytes == pytest.approx(LOGITS, rel=0.01)  # the log-probabilities
    assert m.loss_workspace_bytes == pytest.approx(2 * LOGITS, rel=0.01)


def test_one_stage_prediction_matches_the_allocators_peak_of_a_training_step(profile, monkeypatch) -> None:
    for k, v in LARGE_VOCAB.items():
        monkeypatch.setenv(k, v)
    st = _one_stage(profile).stages[0]
    predicted = st.predicted.memory_bytes - st.predicted.static_memory_bytes
    mf = load_model_file(EXAMPLES / "gpt.py")
    torch.manual_seed(0)
    model = build_checked(mf, BATCH)
    inputs, target = batch_checked(mf, BATCH)
    for p in model.parameters():  # gradients exist already, as from the second microbatch on
        p.grad = torch.zeros_like(p)

    def step() -> None:
        out = model(*inputs)
        loss = mf.loss_fn(out, target)
        del out  # as the runtime's last stage: the loss's graph keeps what it needs
        loss.backward()

    real, _ = peak_new_bytes(step, torch.device("cpu"))
    assert real > 3 * LOGITS  # the logits dominate this step
    assert predicted == pytest.approx(real, rel=0.02)
    # without the loss's working memory the prediction would be a third of the step's peak
    assert predicted - profile.measured.loss_workspace_bytes < 0.5 * real


def test_a_device_that_fits_the_activations_but_not_the_loss_backward_is_refused(profile) -> None:
    p = _one_stage(profile).stages[0].predicted
    held = p.static_memory_bytes + p.activation_bytes_per_microbatch  # one microbatch in flight
    ws = profile.measured.loss_workspace_bytes
    with pytest.raises(PipeplanError, match="does not fit"):
        _one_stage(profile, (held + 0.5 * ws) / 1e9)
    assert _one_stage(profile, (held + 1.01 * ws) / 1e9).predicted.fits_memory
