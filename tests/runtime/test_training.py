"""Pipeline training equals single-device training (real processes, real gloo, CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from plans import traced_layers
from reference import max_abs_diff, reference_train
from runtime_paths import EXAMPLES, MODELS

from profiler.loader import load_model_file

TOL = 1e-5


def _check(run, model, plan, steps, tmp, optimizer="sgd", **plan_kw):
    rc, out, err, _ = run(plan, "--model", model, "--steps", steps, "--optimizer", optimizer,
                          "--save", tmp / "ck", "--report", tmp / "report.json",
                          "--trace", tmp / "trace.json", "--timeout", 60)
    assert rc == 0, err
    ref = reference_train(str(model), steps, optimizer=optimizer, **plan_kw)
    got = torch.load(tmp / "ck" / "model.pt")
    assert max_abs_diff(ref, got) < TOL
    load_model_file(model).build_model().load_state_dict(got)  # strict: every key, none extra
    report = json.loads((tmp / "report.json").read_text())
    return report, out


def test_mlp_two_stages_1f1b(run, tmp_path, monkeypatch):
    monkeypatch.setenv("PIPEPLAN_MLP_DIM", "32")
    model = EXAMPLES / "mlp.py"
    plan = run.plan(model, 2, global_batch=8, microbatch_size=2)
    report, out = _check(run, model, plan, 3, tmp_path)
    # 1F1B keeps S - s microbatches in flight on stage s (m = 4 >= S)
    assert [r["peak_inflight_microbatches"] for r in report["ranks"]] == [2, 1]
    assert [r["schedule_peak_inflight"] for r in report["ranks"]] == [2, 1]
    assert len(report["losses"]) == 3 and "predicted" in out and "measured" in out
    trace = json.loads((tmp_path / "trace.json").read_text())
    # the measured step (process 0) beside the simulator's prediction (process 1), same layout
    for pid in (0, 1):
        names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid}
        assert {"0F0", "0B3", "1F3", "1B0"} <= names
    # each rank's optimizer step, measured and reported (the planner prices it: planner.cost)
    assert {e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 0} >= {
        "optimizer 0", "optimizer 1"}
    assert all(r["optimizer_ms"] > 0 and r["predicted_optimizer_ms"] == 0.0 for r in report["ranks"])


def test_replicated_stage_1f1b_adam(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, [2, 1], global_batch=12, microbatch_size=2)
    report, _ = _check(run, model, plan, 2, tmp_path, optimizer="adam",
                       global_batch=12, microbatch_size=2)
    assert [(r["stage"], r["replica"]) for r in report["ranks"]] == [(0, 0), (0, 1), (1, 0)]
    # replicated 1F1B warms up ceil(sum of replicas from stage s on / r_s) microbatches
    # (ARCHITECTURE.md): ceil(3 / 2) = 2 on each replica of stage 0, 1 on stage 1
    assert [r["peak_inflight_microbatches"] for r in report["ranks"]] == [2, 2, 1]
    assert all(r["peak_inflight_microbatches"] == r["schedule_peak_inflight"] for r in report["ranks"])


def test_replicated_stage_gpipe(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, [2, 1], schedule="gpipe", global_batch=8, microbatch_size=2)
    report, _ = _check(run, model, plan, 2, tmp_path)
    # GPipe keeps every microbatch of a replica in flight: m / r = 2 on stage 0, 4 on stage 1
    assert [r["peak_inflight_microbatches"] for r in report["ranks"]] == [2, 2, 4]


def test_resume_continues_like_an_uninterrupted_run(run, tmp_path):
    model = tmp_path / "model.py"
    model.write_text((MODELS / "seq_mlp.py").read_text())
    plan = run.plan(model, 2)
    common = ["--model", model, "--optimizer", "adam", "--timeout", 60]
    rc, _, err, _ = run(plan, *common, "--steps", 2, "--save", tmp_path / "a")
    assert rc == 0, err
    # the file changed since the plan was made (a comment): a warning with --allow-mismatch
    model.write_text(model.read_text() + "\n# edited after profiling\n")
    rc, _, err, _ = run(plan, *common, "--steps", 2, "--resume", tmp_path / "a",
                        "--save", tmp_path / "b", "--allow-mismatch")
    assert rc == 0, err
    assert "warning" in err and "sha256" in err
    ref = reference_train(str(model), 4, optimizer="adam")
    assert max_abs_diff(ref, torch.load(tmp_path / "b" / "model.pt")) < TOL
    assert json.loads((tmp_path / "b" / "meta.json").read_text())["step"] == 4


def test_gpt_four_stages_with_tied_embedding(run, tmp_path, monkeypatch):
    # the head's weight is the token embedding's: held by stages 0 and 3, gradients summed
    for k, v in {"PIPEPLAN_GPT_TIED": "1", "PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32",
                 "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8"}.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    plan = run.plan(model, 4, global_batch=8, microbatch_size=2)
    # (not Adam here: the key bias of attention has a gradient of exactly zero in theory and
    # ~1e-10 of rounding noise in practice, which Adam divides by its own size; any change in
    # summation order then moves it by ~lr)
    report, _ = _check(run, model, plan, 2, tmp_path, optimizer="momentum")
    assert [r["peak_inflight_microbatches"] for r in report["ranks"]] == [4, 3, 2, 1]


def test_unet_three_stages_skip_connections_cross_stages(run, tmp_path):
    model = EXAMPLES / "unet.py"
    plan = run.plan(model, 3, global_batch=4, microbatch_size=1)
    _check(run, model, plan, 2, tmp_path, global_batch=4, microbatch_size=1)


def test_tied_embedding_with_a_replicated_stage(run, tmp_path, monkeypatch):
    # the tied weight's gradient is summed over stage 0 and both replicas of stage 1
    for k, v in {"PIPEPLAN_GPT_TIED": "1", "PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32",
                 "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8"}.items():
        monkeypatch.setenv(k, v)
    model = EXAMPLES / "gpt.py"
    plan = run.plan(model, [2, 2], [1, 2], global_batch=8, microbatch_size=2)
    report, _ = _check(run, model, plan, 2, tmp_path, optimizer="momentum")
    assert all(r["peak_inflight_microbatches"] == r["schedule_peak_inflight"] for r in report["ranks"])


def test_a_module_called_at_both_ends_sums_its_gradient_over_stages(run, tmp_path, monkeypatch):
    # `shared` and the top-level `pos` are held by stages 0 and 2 under the same names (no
    # alias): each stage's gradient is part of the whole, summed over both (and the replicas)
    monkeypatch.setenv("PIPEPLAN_TEST_NORM", "0")
    model = MODELS / "shared_module.py"
    plan = run.plan(model, [2, 2, 2], [1, 1, 2], global_batch=8, microbatch_size=2)
    _check(run, model, plan, 3, tmp_path)


def test_a_recomputed_block_moves_its_running_statistics_once(run, tmp_path):
    # BatchNorm's running mean, variance and batch counter: once per microbatch, not once more
    # when the backward recomputes the block
    model = MODELS / "shared_module.py"
    plan = run.plan(model, [2, 2, 2], recompute=[True, True, False], global_batch=8, microbatch_size=2)
    _check(run, model, plan, 3, tmp_path)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_recomputed_block_runs_on_the_state_its_forward_found(run, tmp_path, schedule):
    # the blocks read a Python attribute, a buffer and a tensor attribute that each forward
    # moves: by the time the backward recomputes microbatch 0 the later forwards have moved
    # them, so the recomputation must run on what microbatch 0's forward found
    model = MODELS / "stateful_forward.py"
    plan = run.plan(model, [2, 2, 2], recompute=[True, True, False], schedule=schedule,
                    global_batch=8, microbatch_size=2)
    _check(run, model, plan, 3, tmp_path, optimizer="momentum")


def test_a_recomputed_block_draws_from_python_and_numpy_what_its_forward_drew(run, tmp_path):
    """checkpoint restores torch's generators only: a block scaling by `random.uniform` (and
    adding numpy noise) recomputed with other numbers, so its gradient was not that of the
    forward that made the loss (step 1's loss and the weights differed by 0.04)."""
    model = MODELS / "py_random_scale.py"
    got = []
    for k, recompute in enumerate(([False, False], [True, False])):
        plan = run.plan(model, [3, 2], recompute=recompute, global_batch=8, microbatch_size=2,
                        name=f"plan{k}.json")
        rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--save", tmp_path / f"ck{k}",
                            "--timeout", 60)
        assert rc == 0, err
        got.append(torch.load(tmp_path / f"ck{k}" / "model.pt"))
    assert got[0].keys() == got[1].keys()
    for key in got[0]:
        assert torch.equal(got[0][key], got[1][key]), key


def test_a_large_tensor_first_changed_by_a_later_forward_stops_recomputation_clearly(run, tmp_path,
                                                                                      monkeypatch):
    # small tensors are copied by every forward; a larger one only once a forward is seen to
    # change it, so the microbatches in flight before its first change have no copy of it:
    # their recomputation would run on the moved tensor (silently wrong before): a clear error
    monkeypatch.setenv("STATEFUL_LATE_SIZE", "30000")  # 120 kB
    model = MODELS / "stateful_forward.py"
    plan = run.plan(model, [2, 2, 2], recompute=[True, False, False], global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--timeout", 60)
    assert rc != 0 and "changed Cycling.late" in err and "without recomputation" in err, err
    assert "Traceback" not in err, err


def test_two_torchrun_agents_train_like_one_process(run, tmp_path):
    """Two torchrun agents of two ranks each (two nodes, as on a cluster): a replicated stage
    on each node, zb-h1, Adam; the ranks come from torchrun, not from pipeplan's launcher."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from runtime.launch import free_port

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, [2, 2], schedule="zb-h1", global_batch=16, microbatch_size=2)
    root = Path(__file__).resolve().parents[2]
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("PIPEPLAN_ERROR_FILE", None)
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "runtime", str(plan), "--model", str(model), "--steps", "2", "--optimizer", "adam",
         "--timeout", "60", "--save", str(tmp_path / "ck")],
        cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    logs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][1][-3000:] + logs[1][1][-3000:]
    ref = reference_train(str(model), 2, optimizer="adam", global_batch=16, microbatch_size=2)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL
    assert "step 2: loss" in logs[0][0] and "step 2" not in logs[1][0]  # rank 0 reports


def test_a_hand_ordered_plan_whose_first_transfers_differ_per_side(run, tmp_path):
    """Rank 0 runs its backward of microbatch 0 last: its first gradient received is that of
    microbatch 1 while rank 1 sends microbatch 0's first. The shape header of a (peer, key,
    direction) was tagged with the sender's first microbatch, so the receiver waited for a
    header that never came until --timeout, and blamed a healthy peer; it names none now."""
    model = MODELS / "seq_mlp.py"
    path = run.plan(model, 2, global_batch=8, microbatch_size=2)
    plan = json.loads(path.read_text())
    actions = plan["rank_actions"]["0"]
    actions.remove("0B0")
    actions.append("0B0")
    path.write_text(json.dumps(plan))
    _check(run, model, path, 2, tmp_path)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_a_recomputed_block_runs_on_its_python_state_and_generators(run, tmp_path, schedule):
    # a buffer rebound every call, a large one every other call, a list, a dict and the block's
    # own torch, random and numpy generators: the recomputation ran on the moved list, dict,
    # generators and rebound buffer, silently (0.17 apart after 3 steps)
    model = MODELS / "python_state.py"
    plan = run.plan(model, [2, 2], recompute=[True, True], schedule=schedule, global_batch=8,
                    microbatch_size=2)
    _check(run, model, plan, 3, tmp_path)


def test_under_torchrun_the_trace_leaves_the_models_python_state_as_it_found_it(run, tmp_path):
    """Under torchrun every rank traces the model with one forward of its own; it moved the
    blocks' list, dict and generators one call ahead, so training differed from one process
    (the same plan from pipeplan's launcher, whose ranks trace from its record, did not)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from runtime.launch import free_port

    model = MODELS / "python_state.py"
    plan = run.plan(model, [2, 2], global_batch=8, microbatch_size=2)
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root))
    env.pop("PIPEPLAN_ERROR_FILE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
         "-m", "runtime", str(plan), "--model", str(model), "--steps", "2",
         "--timeout", "60", "--save", str(tmp_path / "ck")],
        cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = reference_train(str(model), 2)
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < TOL


@pytest.mark.parametrize("split", [1, 2])
def test_a_recomputed_block_that_changes_its_input_in_place_trains_as_one_process(run, tmp_path, split):
    """Recomputation ran the block again on its input as the first forward had changed it (a
    model normalising its input with `x.sub_(...)`): 4.6e-3 off after 3 steps, also on plans
    the planner made itself where memory binds. It runs on a copy made before now."""
    model = MODELS / "inplace_input.py"
    layers = traced_layers(model, 2)
    plan = run.plan(model, split, recompute=[True] * split, global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    assert len(layers) >= 3, layers
    got = torch.load(tmp_path / "ck" / "model.pt")
    ref = reference_train(str(model), 3)
    assert max_abs_diff(ref, got) < 1e-6


@pytest.mark.parametrize("recompute", [False, True])
def test_modules_train_in_the_modes_build_model_left(run, tmp_path, monkeypatch, recompute):
    """A BatchNorm build_model froze with .eval() (fine-tuning) was set to training on every
    rank (`.train()` on each stage): its statistics moved and every weight came out otherwise.
    Each module now keeps its mode, on recomputed stages too; a model built in eval mode trains
    so, with a warning that says how to train it in training mode."""
    model = MODELS / "frozen_norm.py"
    plan = run.plan(model, [2, 3], recompute=[recompute, recompute], global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    assert "eval mode" not in err
    got = torch.load(tmp_path / "ck" / "model.pt")
    assert int(got["blocks.1.norm.num_batches_tracked"]) == 0
    assert int(got["blocks.0.norm.num_batches_tracked"]) == 12
    assert max_abs_diff(reference_train(str(model), 3), got) < 1e-6

    monkeypatch.setenv("PIPEPLAN_TEST_EVAL", "1")
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--save", tmp_path / "ev", "--timeout", 60)
    assert rc == 0, err
    assert "build_model() returned the model in eval mode" in err and "model.train()" in err, err
    got = torch.load(tmp_path / "ev" / "model.pt")
    assert all(int(v) == 0 for k, v in got.items() if k.endswith("num_batches_tracked"))
    assert max_abs_diff(reference_train(str(model), 2), got) < 1e-6


def test_a_recomputed_block_whose_list_attribute_holds_activations(run, tmp_path):
    """A block keeping activations in a Python list (a feature stack) failed on a recomputed
    stage with deepcopy's "Only Tensors created explicitly by the user support the deepcopy
    protocol": the state kept for the recomputation now holds such tensors by reference."""
    model = MODELS / "feature_stack.py"
    plan = run.plan(model, 1, recompute=[True], global_batch=8, microbatch_size=2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    assert max_abs_diff(reference_train(str(model), 3), torch.load(tmp_path / "ck" / "model.pt")) < 1e-6


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_parameters_and_buffers_a_block_lists_are_trained_as_one_process(run, tmp_path, schedule):
    """A block's own parameters in a plain list, a buffer through a list or dict alias, and an
    LSTM's `_flat_weights`, on a stage without recomputation (the trace put copies in the lists:
    those weights never trained) and one with it (the LSTM ran on stale copies: 2.8e-3 off)."""
    model = MODELS / "aliased_state.py"
    plan = run.plan(model, [3, 3], recompute=[False, True], schedule=schedule, global_batch=8,
                    microbatch_size=2)
    _check(run, model, plan, 3, tmp_path)
