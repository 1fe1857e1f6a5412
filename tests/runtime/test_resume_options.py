"""--resume continues with the checkpoint's optimizer, learning rate and seed unless told
otherwise, and refuses an optimizer whose state the checkpoint does not hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from reference import max_abs_diff, reference_train
from runtime_paths import MODELS


def test_resume_takes_optimizer_lr_and_seed_from_the_checkpoint(run, tmp_path):
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    rc, out, err, _ = run(plan, "--model", model, "--optimizer", "momentum", "--lr", 0.05,
                          "--seed", 3, "--steps", 1, "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    assert "optimizer momentum, lr 0.05)" in out, out  # what trains is said, and where it came from
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a",
                          "--save", tmp_path / "b", "--timeout", 60)
    assert rc == 0, err
    assert "optimizer momentum (the checkpoint's), lr 0.05)" in out, out
    ref = reference_train(str(model), 2, optimizer="momentum", lr=0.05, seed=3)
    assert max_abs_diff(ref, torch.load(tmp_path / "b" / "model.pt")) < 1e-5

    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a",
                        "--optimizer", "adam", "--timeout", 60)
    assert rc == 2 and "trained with momentum" in err and "Traceback" not in err


def test_a_damaged_checkpoint_is_a_clear_error(tmp_path):
    """--resume from a model.pt that is not a tensor checkpoint, or is cut short: one message
    that names the file, not torch.load's traceback (whose advice, weights_only=False, is not
    for a file --save wrote)."""
    import pytest
    import torch

    from planner.errors import PipeplanError
    from runtime import checkpoint

    checkpoint.save(tmp_path, {"w": torch.ones(3)}, {}, {"step": 1})
    assert checkpoint.load(tmp_path)[0]["w"].sum() == 3
    whole = (tmp_path / checkpoint.MODEL_FILE).read_bytes()
    for damaged, why in ((b"garbage\n", "not a tensor checkpoint"), (whole[:100], "RuntimeError"),
                         (b"", "empty")):  # (an empty file: an EOFError without a message, a traceback)
        (tmp_path / checkpoint.MODEL_FILE).write_bytes(damaged)
        with pytest.raises(PipeplanError, match=f"model.pt cannot be read.*{why}"):
            checkpoint.load(tmp_path)


def test_a_checkpoint_that_does_not_fit_the_model_says_which_keys(tmp_path):
    """A model.pt from another model: the message names the missing and unexpected keys (not
    only torch's first line, "Error(s) in loading state_dict"). A key of a buffer the model does
    not persist (`persistent=False`, written by earlier versions when the buffer sat on the model
    itself) is dropped, not refused."""
    import pytest
    import torch
    from torch import nn

    from planner.errors import PipeplanError
    from runtime import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("pe", torch.zeros(3), persistent=False)

    model = Net()
    stale = {**{k: v + 1 for k, v in model.state_dict().items()}, "pe": torch.ones(3)}
    checkpoint.load_model_state(model, stale, tmp_path, "net.py")
    assert torch.equal(model.lin.bias, stale["lin.bias"]) and torch.equal(model.pe, torch.zeros(3))
    other = {"lin.weight": torch.zeros(2, 2), "head.bias": torch.zeros(2)}
    with pytest.raises(PipeplanError, match=r"does not fit net\.py .*Missing key.*lin\.bias.*Unexpected key.*head\.bias"):
        checkpoint.load_model_state(model, other, tmp_path, "net.py")


def test_make_batch_with_the_wrong_rows_is_a_clear_error():
    """A make_batch that returns fewer (or more) rows than asked: the message says which tensor
    and how many rows, not an IndexError from the split."""
    import pytest
    import torch

    from planner.errors import PipeplanError
    from runtime.worker import split_batch

    ok = ((torch.randn(8, 4), torch.zeros(8)), torch.randn(8, 1))
    inputs, targets = split_batch(ok, 2, 4)
    assert len(inputs) == 4 and inputs[3][0].shape == (2, 4) and targets[0].shape == (2, 1)
    with pytest.raises(PipeplanError, match=r"make_batch\(8\) returned input 1 of shape \(6,\)"):
        split_batch(((torch.randn(8, 4), torch.zeros(6)), torch.randn(8, 1)), 2, 4)
    with pytest.raises(PipeplanError, match=r"the target of shape \(10, 1\)"):
        split_batch((torch.randn(8, 4), torch.randn(10, 1)), 2, 4)


THREADS_MODEL = '''
import os

import torch
from torch import nn


class Probe(nn.Module):
    def forward(self, x):  # runs in the rank as written (a leaf of the trace)
        path = os.environ.get("PIPEPLAN_TEST_THREADS_DIR")
        if path:
            with open(os.path.join(path, str(os.getpid())), "w") as f:
                f.write(str(torch.get_num_threads()))
        return x


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.probe = Probe()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(self.probe(x))


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 1)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()
'''


def test_threads_per_rank(run, tmp_path, monkeypatch):
    """--threads sets torch's threads in every rank (a loaded machine wants 1); 0 is refused."""
    model = tmp_path / "threads_model.py"
    model.write_text(THREADS_MODEL)
    plan = run.plan(model, 1, [2])
    seen = tmp_path / "seen"
    seen.mkdir()
    monkeypatch.setenv("PIPEPLAN_TEST_THREADS_DIR", str(seen))
    import os

    threads = (os.cpu_count() or 1) // 2 + 1  # not the default (the cores / 2 ranks)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--threads", threads, "--timeout", 60)
    assert rc == 0, err
    ranks = {f.name: f.read_text() for f in seen.iterdir() if f.name != str(os.getpid())}
    assert len(ranks) == 2 and set(ranks.values()) == {str(threads)}, ranks
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--threads", 0)
    assert rc == 2 and "--threads 0: give 1.." in err


def test_options_that_would_fail_after_training_are_refused_first(run, tmp_path):
    """No rank starts: a NaN or negative learning rate, --save onto a file, --report into a
    directory, a --resume whose meta.json is not what --save writes; and calibrate's own."""
    import json

    from runtime.calibrate import main as calibrate

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "ck").mkdir()
    for name in ("model.pt", "optimizer.pt"):
        (tmp_path / "ck" / name).write_bytes(b"")
    (tmp_path / "ck" / "meta.json").write_text(json.dumps({"lr": "fast"}))
    for args, message in ((["--lr", "nan"], "--lr nan"), (["--lr", "-1"], "--lr -1"),
                          (["--save", tmp_path / "afile"], "is a file"),
                          (["--report", tmp_path], "is a directory"),
                          (["--resume", tmp_path / "ck"], "meta.json is not what --save writes")):
        rc, _, err, secs = run(plan, "--model", model, "--steps", 1, "--timeout", 60, *args)
        assert rc == 2 and message in err and "Traceback" not in err, (args, err)
    # values --save never writes (each failed on every rank after the launch, with a traceback)
    for meta, what in (({"step": 1, "lr": -0.5}, "lr -0.5"), ({"step": 1, "lr": 1e300}, "lr 1e+300"),
                       ({"step": 1, "optimizer": "rmsprop"}, "optimizer 'rmsprop'"),
                       ({"step": -4}, "step -4"), ({"step": 1, "seed": -7}, "seed -7")):
        (tmp_path / "ck" / "meta.json").write_text(json.dumps(meta))
        rc, _, err, secs = run(plan, "--model", model, "--steps", 1, "--timeout", 60,
                               "--resume", tmp_path / "ck")
        assert rc == 2 and f"meta.json is not what --save writes ({what})" in err, (meta, err)
    for args in (["--nproc-per-node", "100000"], ["--rounds", "0"], ["--rounds", "1000000000000"],
                 ["--timeout", "0"], ["--memory-gb", "nan"]):
        assert calibrate([*args, "-o", str(tmp_path / "c.json")]) == 2
    assert not (tmp_path / "c.json").exists()


def test_a_checkpoint_that_cannot_be_written_leaves_the_old_one_and_says_why(tmp_path):
    """--save onto a full disk ended the run with torch's "unexpected pos" traceback and left
    model.pt.tmp, which the next --save refused as a folder of other files. A write that fails
    now removes what it wrote and leaves the previous checkpoint whole; a save interrupted while
    renaming its files is refused on resume, never read as new weights with an old step."""
    import pytest
    import torch

    from planner.errors import PipeplanError
    from runtime import checkpoint

    checkpoint.save(tmp_path, {"w": torch.ones(3)}, {}, {"step": 1})
    (tmp_path / "optimizer.pt.tmp").mkdir()  # a write that fails after model.pt.tmp is written
    with pytest.raises(PipeplanError, match="could not be written .*not saved"):
        checkpoint.save(tmp_path, {"w": torch.zeros(3)}, {}, {"step": 2})
    assert not (tmp_path / "model.pt.tmp").exists()
    model, _, meta = checkpoint.load(tmp_path)
    assert model["w"].sum() == 3 and meta["step"] == 1
    (tmp_path / "optimizer.pt.tmp").rmdir()
    (tmp_path / "meta.json").unlink()  # as a crash between the renames leaves it
    with pytest.raises(PipeplanError, match="interrupted"):
        checkpoint.load(tmp_path)


def test_save_where_the_checkpoint_cannot_fit_is_refused_before_training(tmp_path):
    import pytest

    from planner.errors import PipeplanError
    from runtime.cli import check_room_for_checkpoint

    check_room_for_checkpoint(str(tmp_path / "new" / "ck"), 1000)
    with pytest.raises(PipeplanError, match="checkpoint takes about 1000000000000000.0 MB"):
        check_room_for_checkpoint(str(tmp_path / "ck"), 10**21)


BUFFER_SLICE = """
import torch
from torch import nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)])
        self.register_buffer("table", torch.arange(100.0))
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x + self.table[:4]
def build_model():
    return Net()
def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 4)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""


def test_a_checkpoint_holds_the_models_own_keys_only(run, tmp_path):
    """A top-level forward that slices a buffer made the stage's graph module hold torch.fx's
    `_tensor_constant0`, which the checkpoint saved: build_model().load_state_dict refused it,
    and so did --resume."""
    model = tmp_path / "buffer_slice.py"
    model.write_text(BUFFER_SLICE)
    plan = run.plan(model, 2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    state = torch.load(tmp_path / "a" / "model.pt")
    ns: dict = {}
    exec(BUFFER_SLICE, ns)
    assert sorted(state) == sorted(ns["build_model"]().state_dict())
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err


def test_a_save_interrupted_while_renaming_leaves_the_previous_checkpoint_to_resume(
        run, tmp_path, monkeypatch):
    """A rank killed between a --save-every save's renames left a directory with no meta.json:
    --resume and --save refused it, and both the old checkpoint and the new were lost. The old
    one's files now keep second names until the new one is in, and --resume takes them."""
    from runtime import checkpoint

    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    ck = tmp_path / "ck"
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--save", ck, "--timeout", 60)
    assert rc == 0, err
    state, opt, meta = checkpoint.load(ck)
    renamed: list[str] = []
    real = Path.replace

    def dies_after_one(self: Path, target: Path) -> Path:
        if self.name.endswith(".tmp"):
            renamed.append(self.name)
            if len(renamed) == 2:
                raise KeyboardInterrupt  # the process dies here: nothing after it runs
        return real(self, target)

    monkeypatch.setattr(Path, "replace", dies_after_one)
    with pytest.raises(KeyboardInterrupt):  # a later save, of other weights
        checkpoint.save(ck, {k: torch.zeros_like(v) for k, v in state.items()}, opt, {**meta, "step": 3})
    monkeypatch.undo()
    assert not (ck / "meta.json").exists() and (ck / "meta.json.prev").exists()
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--resume", ck, "--save", ck, "--timeout", 60)
    assert rc == 0, err
    assert "was interrupted while it renamed its files in" in err
    assert max_abs_diff(reference_train(str(model), 4), torch.load(ck / "model.pt")) < 1e-5
    assert json.loads((ck / "meta.json").read_text())["step"] == 4
    assert not list(ck.glob("*.prev")) and not list(ck.glob("*.tmp"))


def test_save_into_another_models_checkpoint_is_refused_and_loses_nothing(run, tmp_path):
    """--save to a directory holding another model's checkpoint replaced it with no word; the
    same model's checkpoint (a run continued, a periodic save) is still replaced as before."""
    first, other = MODELS / "seq_mlp.py", MODELS / "tanh_chain.py"
    plan = run.plan(first, 2)
    rc, _, err, _ = run(plan, "--model", first, "--steps", 1, "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    kept = (tmp_path / "a" / "model.pt").read_bytes()
    rc, _, err, _ = run(plan, "--model", first, "--steps", 1, "--resume", tmp_path / "a",
                        "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["step"] == 2
    kept = (tmp_path / "a" / "model.pt").read_bytes()
    other_plan = run.plan(other, 2)
    rc, _, err, _ = run(other_plan, "--model", other, "--steps", 1, "--save", tmp_path / "a",
                        "--timeout", 60)
    assert rc == 2 and "holds the checkpoint of another model" in err and "Traceback" not in err, err
    assert (tmp_path / "a" / "model.pt").read_bytes() == kept
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["step"] == 2


def test_the_checkpoints_model_digest_is_the_models_state_dict(tmp_path):
    """What the launcher compares (a built model's state dict) is what a save recorded."""
    from runtime import checkpoint

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint.save(tmp_path, state, {}, {"step": 1, "state_digest": checkpoint.state_digest(state)})
    checkpoint.check_same_model(tmp_path, model.state_dict(), "m.py")
    with pytest.raises(Exception, match="another model"):
        checkpoint.check_same_model(tmp_path, torch.nn.Linear(3, 5).state_dict(), "m.py")
    with pytest.raises(Exception, match="another model"):
        checkpoint.check_same_model(tmp_path, model.half().state_dict(), "m.py")


def test_an_optimizer_state_of_another_shape_is_refused_before_any_rank(run, tmp_path):
    """optimizer.pt was never checked against the model: a moment of the wrong shape failed in
    the first optimizer step with torch's traceback."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--optimizer", "adam",
                        "--save", tmp_path / "a", "--timeout", 60)
    assert rc == 0, err
    opt = torch.load(tmp_path / "a" / "optimizer.pt")
    name = next(iter(opt["state"]))
    opt["state"][name]["exp_avg"] = torch.zeros(3, 3, 3)
    torch.save(opt, tmp_path / "a" / "optimizer.pt")
    rc, out, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a", "--timeout", 60)
    assert rc == 2 and "'exp_avg'" in err and "shape (3, 3, 3)" in err and "Traceback" not in err, err
    assert "running" not in out
    opt["state"] = {"no.such.weight": {"step": torch.tensor(1.0)}}
    torch.save(opt, tmp_path / "a" / "optimizer.pt")
    rc, _, err, _ = run(plan, "--model", model, "--steps", 1, "--resume", tmp_path / "a", "--timeout", 60)
    assert rc == 2 and "'no.such.weight'" in err, err


def test_make_batch_told_the_step_continues_after_resume(run, tmp_path, monkeypatch):
    """A make_batch walking a dataset in order started again at its first rows after --resume
    (steps 3-4 retrained on the rows of steps 1-2, no word). Told the step (`make_batch(n,
    step)`) it continues: 2 steps + 2 resumed equal 4; one that is not told is warned about."""
    model = MODELS / "stepped_data.py"
    plan = run.plan(model, 2)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 4, "--save", tmp_path / "four", "--timeout", 60)
    assert rc == 0, err
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--save", tmp_path / "two", "--timeout", 60)
    assert rc == 0, err
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--resume", tmp_path / "two",
                        "--save", tmp_path / "resumed", "--timeout", 60)
    assert rc == 0 and "is told no step" not in err, err
    four = torch.load(tmp_path / "four" / "model.pt")
    assert max_abs_diff(four, torch.load(tmp_path / "resumed" / "model.pt")) == 0.0
    # (and the steps trained on rows of their own: not 4 steps on make_batch's step-0 rows)
    from reference import reference_train

    assert max_abs_diff(four, reference_train(str(model), 4)) > 1e-4

    monkeypatch.setenv("PIPEPLAN_TEST_DATA", "cursor")
    cursor = MODELS / "data_sources.py"
    plan = run.plan(cursor, 2)
    rc, _, err, _ = run(plan, "--model", cursor, "--steps", 1, "--save", tmp_path / "c", "--timeout", 60)
    assert rc == 0 and "is told no step" not in err, err
    rc, _, err, _ = run(plan, "--model", cursor, "--steps", 1, "--resume", tmp_path / "c", "--timeout", 60)
    assert rc == 0 and "--resume at step 1: make_batch(batch_size) is told no step" in err, err
