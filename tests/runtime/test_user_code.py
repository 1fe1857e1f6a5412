"""Stages call the user's own modules: custom autograd Functions (straight-through estimator,
gradient reversal), forward hooks and buffers updated in forward behave exactly as in
single-process training (real processes, gloo)."""

from __future__ import annotations

import torch
from reference import reference_train
from runtime_paths import MODELS

TOL = 1e-5


def _train(run, tmp, plan, model, steps=3):
    rc, _, err, _ = run(plan, "--model", model, "--steps", steps, "--save", tmp / "ck", "--timeout", 60)
    assert rc == 0, err
    return torch.load(tmp / "ck" / "model.pt")


def _diff(a, b, keys):
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in keys)


def test_custom_functions_hooks_and_buffers_two_stages(run, tmp_path):
    model = MODELS / "custom_code.py"
    got = _train(run, tmp_path, run.plan(model, 2), model)
    ref = reference_train(str(model), 3)
    assert set(got) == set(ref)
    assert _diff(got, ref, ref) < TOL  # weights, counters and running means
    # the counters ran once per microbatch forward: 3 steps x 4 microbatches
    assert all(int(v) == 12 for k, v in got.items() if k.endswith(".calls"))


def test_custom_functions_three_stages_with_replicas(run, tmp_path):
    model = MODELS / "custom_code.py"
    got = _train(run, tmp_path, run.plan(model, 3, [1, 2, 1]), model, steps=2)
    ref = reference_train(str(model), 2)
    # weights and integer buffers equal single-process training; the replicated stage's
    # floating-point running means are the replicas' average (runtime/rng.py)
    exact = [k for k, v in ref.items() if k.endswith(".calls") or not k.endswith(".mean")]
    assert _diff(got, ref, exact) < TOL
    assert all(int(v) == 8 for k, v in got.items() if k.endswith(".calls"))


def test_custom_functions_and_tensor_hooks_zb_h1(run, tmp_path):
    """B and W apart: a hook on the tensor where a block's weights join (`z.register_hook`)
    runs once per microbatch, in B, as in one process (W ran it a second time: its weights'
    gradients were halved twice)."""
    model = MODELS / "custom_code.py"
    got = _train(run, tmp_path, run.plan(model, 2, schedule="zb-h1"), model, steps=2)
    ref = reference_train(str(model), 2)
    assert _diff(got, ref, ref) < TOL


def test_plan_over_split_point_layers(run, tmp_path):
    # layers made with `profile --split-points blocks.3`; the plan does not say so (a hand-made
    # plan): the runtime finds the split points from the layer names
    from plans import make_plan, write_plan

    from runtime import stages

    model = MODELS / "custom_code.py"
    mf = __import__("profiler.loader", fromlist=["x"]).load_model_file(model)
    torch.manual_seed(0)
    graph = stages.trace_model(mf.build_model(), mf.make_batch(2)[0], "split:blocks.3")
    layers = stages.layer_names(graph)
    assert layers == ["inp+blocks.0+blocks.1+blocks.2", "blocks.3+blocks.4+blocks.5+out"]
    plan = write_plan(make_plan(model, layers, [1, 1], [1, 1]), tmp_path / "plan.json")
    got = _train(run, tmp_path, plan, model, steps=2)
    assert _diff(got, reference_train(str(model), 2), got) < TOL


def test_setup_runs_no_user_code_on_the_ranks(run, tmp_path, monkeypatch):
    # the launcher traces the model once (its pre-flight check) and hands the ranks what they
    # need: on the ranks the blocks run only in training forwards
    log = tmp_path / "calls.log"
    monkeypatch.setenv("PIPEPLAN_CALL_LOG", str(log))
    model = MODELS / "custom_code.py"
    plan = run.plan(model, 2)
    log.unlink(missing_ok=True)
    _train(run, tmp_path, plan, model, steps=1)
    lines = log.read_text().split()
    calls = list(zip(lines[::2], lines[1::2], strict=True))
    on_ranks = [c for c in calls if c[0] != "-"]
    # 6 blocks, 3 per stage, 4 microbatches, one step: 12 training forwards per rank
    assert sorted(on_ranks) == [("0", "1")] * 12 + [("1", "1")] * 12


def test_parameters_no_replica_used_keep_no_gradient(run, tmp_path):
    """A branch switched off for a whole step: its parameters get no gradient on any replica,
    so the optimizer must skip them as single-device training does (momentum and Adam would
    move them with a zero gradient). One stage on 2 replicas, and 3 stages with the middle one
    replicated; 5 steps, the branch off in steps 0 and 3."""
    from reference import max_abs_diff

    model = MODELS / "optional_branch.py"
    for optimizer in ("momentum", "adam"):
        for split, replicas in (([5], [2]), ([2, 2, 1], [1, 2, 1])):
            plan = run.plan(model, split, replicas, name=f"plan{len(split)}.json")
            ck = tmp_path / f"ck-{optimizer}-{len(split)}"
            rc, _, err, _ = run(plan, "--model", model, "--steps", 5, "--optimizer", optimizer,
                                "--lr", 0.05, "--save", ck, "--timeout", 60)
            assert rc == 0, err
            ref = reference_train(str(model), 5, optimizer=optimizer, lr=0.05)
            assert max_abs_diff(ref, torch.load(ck / "model.pt")) < TOL, (optimizer, split)


def test_lazy_modules_start_from_the_same_weights_as_a_dry_run(run, tmp_path):
    """A model of lazy modules, cut through them (2 and 3 stages, the last replicated; the
    BatchNorm's stage is not: replicas average running statistics, tests/runtime/test_buffers.py):
    every rank initialises them as one dry run after build_model would, then trains as one
    process does. Before, the ranks failed with a traceback on the uninitialised parameters."""
    from reference import max_abs_diff

    model = MODELS / "lazy_mlp.py"
    ref = reference_train(str(model), 3, dry_run=True)
    for split, replicas in (([2, 3], [1, 1]), ([1, 2, 2], [1, 1, 2])):
        plan = run.plan(model, split, replicas, name=f"plan{len(split)}.json")
        got = _train(run, tmp_path / str(len(split)), plan, model)
        assert max_abs_diff(ref, got) < TOL, split


def test_sparse_embedding_gradients_on_replicas(run, tmp_path):
    """nn.Embedding(sparse=True) on a replicated stage: the replicas' sparse gradients are
    summed (dense on the wire, sparse again after), so SGD and momentum train as one process
    does; Adam, which refuses sparse gradients, gets a one-line error. Before, the gradient
    all-reduce failed with a traceback (reshape of a sparse tensor)."""
    from reference import max_abs_diff

    model = MODELS / "sparse_embedding.py"
    plan = run.plan(model, [1, 3], [2, 1])
    for optimizer in ("sgd", "momentum"):
        ck = tmp_path / f"ck-{optimizer}"
        rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--optimizer", optimizer, "--save", ck,
                            "--timeout", 60)
        assert rc == 0, err
        ref = reference_train(str(model), 3, optimizer=optimizer)
        assert max_abs_diff(ref, torch.load(ck / "model.pt")) < TOL, optimizer
    # refused before any rank starts: Adam, and weight decay (SGD adds the dense weights)
    for extra in (["--optimizer", "adam"], ["--weight-decay", "0.01"]):
        rc, out, err, _ = run(plan, "--model", model, "--steps", 1, *extra, "--timeout", 60)
        assert rc == 2 and "sparse gradient" in err and "Traceback" not in err, err
        assert "running" not in out


def test_a_stage_without_parameters_trains_and_resumes(run, tmp_path):
    """A stage of layers without parameters (an activation alone, on two replicas) has no
    optimizer to step (torch's refuse an empty parameter list: every run of such a plan
    failed); training equals single-process training with Adam, and a checkpoint resumes."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, [1, 1, 4], [1, 2, 1])
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--optimizer", "adam", "--save",
                        tmp_path / "ck1", "--timeout", 60)
    assert rc == 0, err
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--optimizer", "adam", "--resume",
                        tmp_path / "ck1", "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    got = torch.load(tmp_path / "ck" / "model.pt")
    ref = reference_train(str(model), 2, optimizer="adam")
    assert set(got) == set(ref)
    assert _diff(got, ref, ref) < TOL


def test_a_transposed_view_crossing_a_cut_arrives_with_its_strides(run, tmp_path):
    """Cut between a block returning `y.t()` and one reading `x.t()`: the receiver gets the
    sender's layout, so the next matmul rounds as in single-process training (sent as a
    contiguous copy, the weights differed by 1.1e-5 after 3 steps on a model like this)."""
    from runtime.comm import memory_order

    assert memory_order(torch.randn(3, 4).t()) == (1, 0)
    assert memory_order(torch.randn(4, 6)[:, :3]) == (0, 1)  # not dense: sent as a copy
    model = MODELS / "transposed.py"
    got = _train(run, tmp_path, run.plan(model, [2, 2]), model)
    ref = reference_train(str(model), 3)
    assert _diff(got, ref, ref) == 0.0  # bit for bit: the same kernels on the same layouts


def test_make_batch_from_numpy_or_a_dataset_cursor_trains_as_one_process(run, tmp_path, monkeypatch):
    """make_batch drawing from numpy's global generator (it gave each rank other rows: the
    last stage's targets were not for the first stage's inputs), or walking a dataset in order
    (the ranks' setup called it once more: step 1 trained on rows 2-9, not 0-7)."""
    model = MODELS / "data_sources.py"
    for source in ("numpy", "cursor"):
        monkeypatch.setenv("PIPEPLAN_TEST_DATA", source)
        got = _train(run, tmp_path, run.plan(model, 3, [1, 2, 1], name=f"{source}.json"), model)
        assert _diff(got, reference_train(str(model), 3), got) < TOL, source


def test_make_batch_that_differs_between_ranks_is_refused(run, tmp_path, monkeypatch):
    model = MODELS / "data_sources.py"
    monkeypatch.setenv("PIPEPLAN_TEST_DATA", "own-rng")
    rc, _, err, _ = run(run.plan(model, 2), "--model", model, "--steps", 2, "--timeout", 60)
    assert rc != 0
    assert "make_batch(8) gave ranks 0 and 1 different batches at step 0" in err, err
    assert "Traceback" not in err


def test_initial_weights_from_numpy_train_as_one_process_and_others_are_refused(run, tmp_path, monkeypatch):
    """build_model drawing its weights from numpy's global generator: only torch's was seeded
    before it, so the two replicas of stage 0 started from other weights and stayed apart, with
    no word (an outside review). Now every generator is seeded with --seed; a generator of the
    model's own (other weights on every process) is refused, naming build_model."""
    model = MODELS / "data_sources.py"
    monkeypatch.setenv("PIPEPLAN_TEST_INIT", "numpy")
    got = _train(run, tmp_path, run.plan(model, 3, [2, 1, 1], name="init.json"), model)
    assert _diff(got, reference_train(str(model), 3), got) < TOL
    monkeypatch.setenv("PIPEPLAN_TEST_INIT", "own-rng")
    rc, _, err, _ = run(run.plan(model, 2, [2, 1], name="own.json"), "--model", model, "--steps", 1,
                        "--timeout", 60)
    assert rc != 0 and "build_model() gave ranks 0 and 1 different weights" in err, err
    assert "Traceback" not in err
    # another architecture on rank 1 (a bias left out there): named as such, not as weights
    monkeypatch.setenv("PIPEPLAN_TEST_INIT", "rank-arch")
    rc, _, err, _ = run(run.plan(model, 2, [2, 1], name="arch.json"), "--model", model, "--steps", 1,
                        "--timeout", 60)
    assert rc != 0 and "build_model() gave ranks 0 and 1 different models" in err, err
    assert "Traceback" not in err


def test_a_tensor_the_runtime_cannot_send_across_a_cut_is_named(run, tmp_path):
    """A complex tensor crossing a stage boundary stopped every rank with a traceback ending
    "ValueError: torch.complex64 is not in list" (a tensor of 9 dimensions: "cannot be sent",
    naming no tensor)."""
    model = MODELS / "complex_cut.py"
    rc, out, err, _ = run(run.plan(model, [1, 2]), "--model", model, "--steps", 1, "--timeout", 30)
    assert rc == 2 and "crosses a stage boundary" in err and "complex64" in err, err
    assert "Traceback" not in err and "not in list" not in err


def test_a_loss_that_keeps_state_is_called_once_per_microbatch(run, tmp_path):
    """The last stage measured the loss's working memory by calling loss_fn once more in the
    first step: a loss that keeps state (DINO's running centre) moved it once too often, 2.5e-3
    off after 3 steps. It measures on a copy of the loss now."""
    model = MODELS / "stateful_loss.py"
    got = _train(run, tmp_path, run.plan(model, 2), model)
    ref = reference_train(str(model), 3)
    assert _diff(got, ref, ref) < TOL


def test_a_hook_on_a_weight_tied_across_stages_is_warned_about(run, tmp_path):
    """Each stage runs a tied weight's gradient hooks on its own part of the gradient (clamp(a)
    + clamp(b) where one process computes clamp(a + b)): said before the ranks start."""
    model = MODELS / "tied_hook.py"
    rc, _, err, _ = run(run.plan(model, 1), "--model", model, "--steps", 1, "--timeout", 60)
    assert rc == 0 and "tied across stages" not in err, err
    rc, _, err, _ = run(run.plan(model, 2, name="two.json"), "--model", model, "--steps", 1, "--timeout", 60)
    assert rc == 0 and "emb.weight is tied across stages 0, 1 and has gradient hooks" in err, err


def test_an_output_the_loss_does_not_read_gives_its_weights_no_gradient(run, tmp_path):
    """A stage's output the loss ignores (a probe head's, returned beside the prediction) got a
    zero gradient sent back for it, which made its weights' gradients zeros instead of None: AdamW's
    weight decay and momentum then moved them (7.2e-4 off after 3 steps). No gradient is sent now,
    and the weights keep none, as in one process."""
    model = MODELS / "unused_output.py"
    plan = run.plan(model, [2, 4])
    rc, _, err, _ = run(plan, "--model", model, "--steps", 3, "--optimizer", "adam", "--weight-decay", 0.1,
                        "--save", tmp_path / "ck", "--timeout", 60)
    assert rc == 0, err
    got = torch.load(tmp_path / "ck" / "model.pt")
    ref = reference_train(str(model), 3, optimizer="adam", weight_decay=0.1)
    assert _diff(got, ref, ref) < TOL


def test_a_tensor_that_needs_no_gradient_arrives_needing_none(run, tmp_path):
    """Every float tensor a stage received was made to need a gradient (and so was every layer's
    input in the profiler): a block reading a frozen extractor's no_grad output with .numpy(),
    legal in one process, failed on the rank (and `planner profile` with a traceback)."""
    from profiler.profile import profile_model_file

    model = MODELS / "frozen_features.py"
    profile_model_file(str(model), batch_size=2, warmup=1, repeats=1)
    got = _train(run, tmp_path, run.plan(model, [1, 4]), model)
    ref = reference_train(str(model), 3)
    assert _diff(got, ref, ref) < TOL


def test_a_wrapped_body_fx_cannot_trace_is_split_at_its_blocks(run, tmp_path):
    """A wrapper of the user's around a body torch.fx calls whole (an outside review's wrapped
    GPT2LMHeadModel): the body's blocks are layers (torch.export keeps them as calls), the ranks
    trace the same way, and 3 stages starting inside the body train as one process does."""
    from plans import traced_layers

    model = MODELS / "wrapped_body.py"
    names = traced_layers(model, 2)
    assert [n for n in names if n.startswith("body.blocks.")] == [f"body.blocks.{i}" for i in range(4)]
    got = _train(run, tmp_path, run.plan(model, 3), model)
    ref = reference_train(str(model), 3)
    assert _diff(got, ref, ref) < TOL


def test_a_wrapped_body_export_gets_wrong_stays_one_layer_on_every_rank(run, tmp_path):
    """The same wrapper passing a Python number to the blocks: the exported graph drops it
    (its check against the model fails), so the body is one layer, and the ranks, which trace
    from the launcher's record without that check, take fx's way too (they took export's, and
    their layers were not the plan's)."""
    import warnings

    from plans import traced_layers

    model = MODELS / "wrapped_scalar.py"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert traced_layers(model, 2) == ["body", "head"]
    got = _train(run, tmp_path, run.plan(model, [1, 1]), model)
    ref = reference_train(str(model), 3)
    assert _diff(got, ref, ref) < TOL


def test_a_tied_weight_the_forward_changes_in_place_is_refused_across_stages(run, tmp_path):
    """nn.Embedding(max_norm=...) tied to the head: on one stage it trains as one process; cut
    between them, the copies would part (only the embedding's is renormalised), so the run stops
    at the first forward naming the parameter and what to do."""
    model = MODELS / "tied_max_norm.py"
    rc, _, err, _ = run(run.plan(model, 1), "--model", model, "--steps", 3, "--save", tmp_path / "ck",
                        "--timeout", 60)
    assert rc == 0, err
    assert _diff(torch.load(tmp_path / "ck" / "model.pt"), ref := reference_train(str(model), 3), ref) < TOL
    rc, _, err, _ = run(run.plan(model, 2, name="two.json"), "--model", model, "--steps", 3, "--timeout", 60)
    assert rc == 2 and "changes parameter 'emb.weight' in place" in err and "tied across stages 0, 1" in err, err
    assert "Traceback" not in err
    # replicas of one stage: each renormalises the rows its own microbatches read (4.24 off one
    # process after 3 steps, silently, a review found)
    rc, _, err, _ = run(run.plan(model, 1, [2], name="replicas.json"), "--model", model, "--steps", 3,
                        "--timeout", 60)
    assert rc == 2 and "changes parameter 'emb.weight' in place" in err and "has 2 replicas" in err, err


def test_a_momentum_encoder_trains_as_one_process_recomputed(run, tmp_path, monkeypatch):
    """Frozen parameters a block's forward moves under no_grad (MoCo's key encoder): a
    recomputed stage ran that update twice per microbatch (the recomputation found the encoder
    as the later forwards had left it and moved it once more), 1.5e-4 off one process after 3
    steps, silently (an outside review). Through `.data` (no version moves) and in place under
    no_grad, small tensors and larger ones; 1f1b and zb-h1."""
    model = MODELS / "momentum_encoder.py"
    cases = [("data", "16", "1f1b"), ("data", "160", "zb-h1"), ("version", "160", "1f1b")]
    for inplace, dim, schedule in cases:
        monkeypatch.setenv("PIPEPLAN_MOMENTUM_INPLACE", inplace)
        monkeypatch.setenv("PIPEPLAN_MOMENTUM_DIM", dim)
        case = tmp_path / f"{inplace}-{dim}-{schedule}"
        case.mkdir()
        plan = run.plan(model, [3, 3], recompute=[True, True], schedule=schedule, name=f"{case.name}.json")
        got = _train(run, case, plan, model)
        ref = reference_train(str(model), 3)
        assert _diff(got, ref, ref) < TOL, (inplace, dim, schedule)


def test_parameters_a_forward_sets_through_data_are_refused_on_replicas(run, tmp_path, monkeypatch):
    """Glow's ActNorm sets its parameters from the first batch through `.data` (no version
    moves): on one replica per stage it trains as one process (recomputed too); on two, each
    replica set them from its own microbatch, 1.0 off one process's first loss and the copies
    apart for good, silently (an outside review). Refused at the first forward now; so is a
    momentum encoder (frozen parameters each forward moves: each replica moved its copy by its
    own microbatches' forwards only)."""
    model = MODELS / "actnorm.py"
    got = _train(run, tmp_path, run.plan(model, [3, 3], recompute=[True, False]), model)
    assert _diff(got, ref := reference_train(str(model), 3), ref) < TOL
    rc, _, err, _ = run(run.plan(model, [3, 3], [2, 1], name="replicas.json"), "--model", model,
                        "--steps", 3, "--timeout", 60)
    assert rc == 2 and "changes parameter 'blocks.0.an.loc' in place" in err and "has 2 replicas" in err, err
    assert "Traceback" not in err
    model = MODELS / "momentum_encoder.py"
    rc, _, err, _ = run(run.plan(model, [3, 3], [1, 2], name="momentum.json"), "--model", model,
                        "--steps", 3, "--timeout", 60)
    assert rc == 2 and "changes parameter 'blocks.2.k.weight' in place" in err and "has 2 replicas" in err, err
