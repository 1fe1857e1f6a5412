"""`python -m planner profile` end to end on every example, and on every kind of bad input:
exit status 2 and a message naming the file, the function and what to do (no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from profiler_helpers import EXAMPLES, ROOT

from planner.formats import Profile
from planner.io import load_model


def _profile(args: list[str], cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "planner", "profile", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
def test_profile_each_example(small_env, tmp_path, name) -> None:
    out = tmp_path / "profile.json"
    r = _profile([str(EXAMPLES / f"{name}.py"), "--batch-size", "4", "-o", str(out),
                  "--warmup", "0", "--repeats", "2"])
    assert r.returncode == 0, r.stderr
    profile = load_model(out, Profile)
    assert profile.batch_size == 4 and profile.device.type == "cpu"
    assert profile.measured is not None and profile.measured.fwd_ms > 0
    assert "per-layer sum / whole model" in r.stdout
    for layer in profile.layers:
        assert layer.name in r.stdout
    if name == "unet":  # skip edges make it a DAG
        assert any(e.src == "stem" and e.dst.startswith("up.") for e in profile.edges)


GOOD = """
import torch
def build_model():
    return torch.nn.Linear(4, 2)
def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 2)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""


@pytest.mark.parametrize(
    "case,source,expected",
    [
        ("missing_function", GOOD.replace("def build_model", "def make_model"),
         ["missing function build_model", "def build_model() -> torch.nn.Module"]),
        ("raising_function", GOOD.replace("return (torch.randn(n, 4),), torch.randn(n, 2)", "raise ValueError('no data')"),
         ["make_batch(4) raised ValueError: no data", "line 6", "Fix make_batch"]),
        ("syntax_error", GOOD + "\ndef broken(:\n", ["syntax error at line", "Fix the file"]),
        ("not_a_module", GOOD.replace("return torch.nn.Linear(4, 2)", "return 3"),
         ["build_model() returned int, not a torch.nn.Module"]),
        # an instance is callable: it was called as build_model() and blamed Linear.forward
        ("an_instance", GOOD.replace("def build_model():\n    return torch.nn.Linear(4, 2)",
                                     "build_model = torch.nn.Linear(4, 2)"),
         ["build_model is a Linear module, not a function", "def build_model() -> torch.nn.Module"]),
        ("wrong_inputs", GOOD.replace("torch.randn(n, 4),", "torch.randn(n, 5),"),
         ["make_batch's inputs must be the model's positional arguments"]),
        ("loss_not_scalar", GOOD.replace("return ((out - y) ** 2).mean()", "return (out - y) ** 2"),
         ["loss_fn(output, target) returned a tensor of shape (4, 2)", ".mean()"]),
        ("inplace_on_saved", GOOD.replace("return ((out - y) ** 2).mean()",
                                          "z = out.sigmoid()\n    z.mul_(2)\n    return ((z - y) ** 2).mean()"),
         ["one training step", "raised RuntimeError", "in-place"]),
        ("dict_target", GOOD.replace("torch.randn(n, 2)", "{'y': torch.randn(n, 2)}")
         .replace("return ((out - y) ** 2).mean()", "return ((out - y['y']) ** 2).mean()"),
         ["returned a target of type dict", "one tensor whose first dimension is the batch"]),
        ("fails_later", GOOD.replace("return torch.nn.Linear(4, 2)",
                                     "class M(torch.nn.Linear):\n        calls = 0\n"
                                     "        def forward(self, x):\n            M.calls += 1\n"
                                     "            if M.calls == 5:\n                raise RuntimeError('fifth call')\n"
                                     "            return super().forward(x)\n    return M(4, 2)"),
         ["the model ran once, then raised RuntimeError: fifth call", "the same way each time"]),
        ("reentrant_checkpoint", GOOD.replace(
            "    return torch.nn.Linear(4, 2)",
            "    from torch.utils.checkpoint import checkpoint\n"
            "    class M(torch.nn.Linear):\n"
            "        def forward(self, x):\n"
            "            return checkpoint(super().forward, x, use_reentrant=True)\n"
            "    return torch.nn.Sequential(torch.nn.Linear(4, 4), M(4, 2))"),
         ["use_reentrant=True", "Pass use_reentrant=False"]),
        ("exits", GOOD.replace("return torch.nn.Linear(4, 2)", "import sys\n    sys.exit(0)"),
         ["build_model() called sys.exit(0)", "must return, not exit"]),
        ("flat_target", GOOD.replace("torch.randn(n, 2)", "torch.randn(n * 2)")
         .replace("return ((out - y) ** 2).mean()", "return ((out.reshape(-1) - y) ** 2).mean()"),
         ["the target has shape (8,)", "first dimension must be the batch (4)"]),
    ],
)
def test_bad_model_files_are_clear_errors(tmp_path, case, source, expected) -> None:
    path = tmp_path / f"{case}.py"
    path.write_text(source)
    r = _profile([str(path), "--batch-size", "4", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert str(path) in r.stderr
    for text in expected:
        assert text in r.stderr, r.stderr
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("args,expected", [(["--threads", "100000"], "--threads 100000: give 1.."),
                                           (["--repeats", "10000000000"], "--repeats 1..10000"),
                                           # torch's C++ overflow, blamed on make_batch
                                           (["--batch-size", "99999999999999999999"], "from 1 to 2147483647"),
                                           # (ignored without a word: an outside review)
                                           (["--keep-call-overhead"], "applies to --layer-timing isolated only")])
def test_absurd_threads_and_repeats_are_refused(tmp_path, args, expected) -> None:
    """(--threads 100000 crashed torch with a segmentation fault; 10**10 repeats ran on.)"""
    path = tmp_path / "good.py"
    path.write_text(GOOD)
    r = _profile([str(path), "--batch-size", "4", "-o", str(tmp_path / "p.json"), *args])
    assert r.returncode == 2 and expected in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_missing_file_is_a_clear_error(tmp_path) -> None:
    r = _profile([str(tmp_path / "nope.py")])
    assert r.returncode == 2 and "no such model file" in r.stderr and "Traceback" not in r.stderr
    r = _profile([str(tmp_path)])  # it said "no such model file" of a directory that exists
    assert r.returncode == 2 and "is a directory, not a file" in r.stderr, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_is_a_clear_error(small_env, tmp_path) -> None:
    r = _profile([str(EXAMPLES / "mlp.py"), "--device", "cuda", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "no CUDA device" in r.stderr and "--device cpu" in r.stderr



@pytest.mark.parametrize("body", ["return torch.nn.Linear(4, 2).requires_grad_(False)",
                                  "return torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Tanh())"
                                  ".requires_grad_(False)"])
def test_a_model_with_nothing_to_train_is_a_clear_error(tmp_path, body) -> None:
    # it read "no in-place change of a tensor autograd saved", the advice for another error
    path = tmp_path / "frozen.py"
    path.write_text(GOOD.replace("return torch.nn.Linear(4, 2)", body))
    r = _profile([str(path), "--batch-size", "4", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "nothing to train" in r.stderr and "in-place" not in r.stderr, r.stderr


DATACLASS_OUT = """
import dataclasses
import torch


@dataclasses.dataclass
class Out:
    logits: torch.Tensor


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 2)

    def forward(self, x):
        return Out(self.lin(x))


def build_model():
    return M()
def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 2)
def loss_fn(out, y):
    return ((out.logits - y) ** 2).mean()
"""


def test_an_output_pytree_cannot_see_into_is_a_clear_error(tmp_path) -> None:
    """A forward returning a dataclass trains by hand; the profiler then said "the model ran
    once, then raised RuntimeError: `inputs` argument to `grad()` cannot be empty ... it must
    run the same way each time"."""
    path = tmp_path / "dc.py"
    path.write_text(DATACLASS_OUT)
    r = _profile([str(path), "--batch-size", "4", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "returns a 'Out' object whose tensors" in r.stderr, r.stderr
    assert "namedtuple" in r.stderr and "same way each time" not in r.stderr


def test_a_model_that_runs_differently_each_pass_is_a_clear_error(tmp_path) -> None:
    """Stochastic depth drawn from Python's random (seeded here so that the passes differ):
    the per-layer figures contradicted each other and the profiler printed pydantic's
    ValidationError traceback, saying "give the profile pipeplan wrote"."""
    source = (
        "import random\nimport torch\nfrom torch import nn\nrandom.seed(1)\n"
        "class B(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        if self.training and random.random() < 0.5:\n            return x\n"
        "        return x + torch.tanh(self.fc(x))\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        self.blocks = nn.ModuleList([B() for _ in range(4)])\n        self.head = nn.Linear(8, 2)\n"
        "    def forward(self, x):\n        for b in self.blocks:\n            x = b(x)\n        return self.head(x)\n"
        "def build_model():\n    return M()\n"
        "def make_batch(n):\n    return (torch.randn(n, 8),), torch.randn(n, 2)\n"
        "def loss_fn(o, y):\n    return nn.functional.mse_loss(o, y)\n")
    path = tmp_path / "stochastic_depth.py"
    path.write_text(source)
    r = _profile([str(path), "--batch-size", "2", "--warmup", "0", "--repeats", "1", "--threads", "1",
                  "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "passes that measured the model disagree" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and "ValidationError" not in r.stderr


def test_stopping_a_command_stuck_in_the_model_file_names_where(tmp_path) -> None:
    """A build_model that never returns: Ctrl-C printed "interrupted" alone, not where."""
    import signal
    import time

    marker = tmp_path / "building"
    path = tmp_path / "stuck.py"
    path.write_text(GOOD.replace("def build_model():\n",
                                 f"def build_model():\n    open({str(marker)!r}, 'w').close()\n"
                                 "    import time\n    time.sleep(600)\n"))
    p = subprocess.Popen([sys.executable, "-m", "planner", "profile", str(path), "-o", str(tmp_path / "p.json")],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        end = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < end and p.poll() is None:
            time.sleep(0.1)
        assert marker.exists()
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 130 and f"{path}:" in err and "(build_model)" in err, err


def test_a_model_file_imports_a_module_beside_it(tmp_path) -> None:
    """As `python model.py` can: the file's folder is on the import path (it said
    "ModuleNotFoundError: No module named 'helpers_pp'")."""
    folder = tmp_path / "proj"
    folder.mkdir()
    (folder / "helpers_pp.py").write_text("import torch\n\nWIDTH = 4\n")
    (folder / "model.py").write_text(GOOD.replace("import torch", "import torch\nfrom helpers_pp import WIDTH", 1))
    r = _profile([str(folder / "model.py"), "--batch-size", "4", "-o", str(tmp_path / "p.json"),
                  "--warmup", "0", "--repeats", "1"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr


# make_batch and loss_fn of the 4-wide models below
CONTRACT_4 = """
def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 4)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""


BORROW = """
import torch
from torch import nn
class Lin(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        return torch.tanh(self.lin(x))
class Borrow(nn.Module):
    def __init__(self, other):
        super().__init__()
        self.other = OTHER
        self.bias = nn.Parameter(torch.zeros(4))
    def forward(self, x):
        return torch.tanh(x @ self.other[0].lin.weight.t() + self.bias)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        b0 = Lin()
        self.blocks = nn.ModuleList([b0, Lin(), Borrow(b0)])
    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x
def build_model():
    return Net()
""" + CONTRACT_4


def test_a_layer_using_a_parameter_it_does_not_hold_is_refused(tmp_path) -> None:
    """blocks.2 reads blocks.0's weight through a plain list: no trace sees it, and a stage of
    blocks.2 trained its own copy (the profile said nothing; gradients were silently wrong
    across stages). Registered (an nn.ModuleList), it is a shared parameter of both layers."""
    bad = tmp_path / "borrow.py"
    bad.write_text(BORROW.replace("OTHER", "[other]"))
    r = _profile([str(bad), "--batch-size", "4", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "layer blocks.2 uses the parameter blocks.0.lin.weight without holding it" in r.stderr
    good = tmp_path / "registered.py"
    good.write_text(BORROW.replace("OTHER", "nn.ModuleList([other])"))
    r = _profile([str(good), "--batch-size", "4", "-o", str(tmp_path / "p.json"), "--repeats", "1"])
    assert r.returncode == 0, r.stderr
    shared = load_model(tmp_path / "p.json", Profile).shared_parameters
    assert any(s.layers == ["blocks.0", "blocks.2"] and "blocks.0.lin.weight" in s.keys for s in shared)


SLEEPY = """
import time
import torch
class Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        time.sleep(0.02)
        return x * 1.0
    @staticmethod
    def backward(ctx, g):
        time.sleep(0.02)
        return g
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
    def forward(self, x):
        return Wait.apply(self.lin(x))
def build_model():
    return torch.nn.Sequential(Block(), Block())
""" + CONTRACT_4


def test_thread_clock_on_a_model_that_waits_is_warned(tmp_path) -> None:
    """--clock thread counts this thread's CPU time: a model that sleeps 80 ms a pass was
    profiled at well under 1 ms, silently."""
    path = tmp_path / "sleepy.py"
    path.write_text(SLEEPY)
    r = _profile([str(path), "--batch-size", "4", "--threads", "1", "--clock", "thread",
                  "--warmup", "0", "--repeats", "2", "-o", str(tmp_path / "p.json")])
    assert r.returncode == 0, r.stderr
    assert "warning: a whole pass took" in r.stderr and "profile with --clock wall" in r.stderr, r.stderr
    wall = load_model(tmp_path / "p.json", Profile).measured.wall_ms
    assert wall is not None and wall >= 80
    # -q drops the table, not the warning (it was printed as part of the table: an outside review)
    r = _profile([str(path), "--batch-size", "4", "--threads", "1", "--clock", "thread",
                  "--warmup", "0", "--repeats", "2", "-q", "-o", str(tmp_path / "q.json")])
    assert r.returncode == 0 and r.stdout == "", r.stdout
    assert "warning: a whole pass took" in r.stderr, r.stderr
    r = _profile([str(path), "--batch-size", "4", "--warmup", "0", "--repeats", "2", "-o",
                  str(tmp_path / "w.json")])
    assert r.returncode == 0 and "warning: a whole pass" not in r.stdout + r.stderr
    assert load_model(tmp_path / "w.json", Profile).measured.wall_ms is None  # (the figures are wall)


CTX_ATTR = """
import torch
from torch import nn
class KeepsOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.big = torch.ones(BIG)  # kept for backward, but not with save_for_backward
        return x * 2
    @staticmethod
    def backward(ctx, g):
        return g * ctx.big[0] * 2
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
    def forward(self, x):
        return KeepsOnCtx.apply(self.lin(x))
def build_model():
    return nn.Sequential(Block(), Block())
""" + CONTRACT_4


@pytest.mark.parametrize("big,warned", [(1 << 20, True), (4, False)])
def test_tensors_kept_as_ctx_attributes_are_warned(tmp_path, big, warned) -> None:
    """Saved-tensor hooks see only ctx.save_for_backward: 4 MB kept as `ctx.big` were left out
    of the activation bytes without a word. A few bytes (a scalar) are not worth a warning."""
    path = tmp_path / "ctx.py"
    path.write_text(CTX_ATTR.replace("BIG", str(big)))
    r = _profile([str(path), "--batch-size", "4", "--warmup", "0", "--repeats", "1", "-o",
                  str(tmp_path / "p.json")])
    assert r.returncode == 0, r.stderr
    said = "the custom autograd.Function KeepsOnCtx keeps 4.19 MB as ctx attributes (ctx.big)"
    assert (said in r.stderr) == warned, r.stderr
    assert ("2 such Functions" in r.stderr) == warned
