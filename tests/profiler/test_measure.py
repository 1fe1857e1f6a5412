"""Measured bytes against analytic values, and a whole profile against the schema."""

from __future__ import annotations

import json

import pytest
import torch
from profiler_helpers import EXAMPLES
from torch import nn

from planner.formats import Profile
from profiler.graph import build_stage, trace
from profiler.measure import count_saved_bytes, measure_layers, measure_whole
from profiler.profile import profile_model_file

B = 5
F32 = 4


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(16, 4)
        self.sig = nn.Sigmoid()
        self.gelu = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gelu(self.sig(self.fc2(self.relu(self.fc1(x)))))


def _layers(model: nn.Module, x: torch.Tensor):
    lg = trace(model, (x,), granularity="modules")
    return lg, {m.name: m for m in measure_layers(lg, (x,), torch.device("cpu"), warmup=0, repeats=1)}


def test_activation_bytes_of_known_layers_match_analytic_values() -> None:
    torch.manual_seed(0)
    lg, m = _layers(Net(), torch.randn(B, 8))
    assert lg.layer_names() == ["fc1", "relu", "fc2", "sig", "gelu"]
    assert m["fc1"].activation_bytes == B * 8 * F32  # Linear keeps its input (weight excluded)
    assert m["relu"].activation_bytes == B * 16 * F32  # ReLU keeps its output
    assert m["fc2"].activation_bytes == B * 16 * F32  # its input
    assert m["sig"].activation_bytes == B * 4 * F32  # Sigmoid keeps its output
    assert m["gelu"].activation_bytes == B * 4 * F32  # GELU keeps its input
    for name, out_features in [("fc1", 16), ("relu", 16), ("fc2", 4), ("sig", 4), ("gelu", 4)]:
        assert m[name].output_bytes == B * out_features * F32


def test_saved_storage_counted_once_in_the_whole_model() -> None:
    """ReLU's output is also fc2's input, Sigmoid's output GELU's input: each storage is counted
    once for the whole model (the per-layer numbers count it in both layers)."""
    torch.manual_seed(0)
    model, x = Net(), torch.randn(B, 8)
    whole = measure_whole(model, (x,), torch.zeros(B, 4), nn.functional.mse_loss, torch.device("cpu"),
                          warmup=0, repeats=1)
    assert whole.activation_bytes == (B * 8 + B * 16 + B * 4) * F32


def test_views_keep_their_whole_storage() -> None:
    x = torch.randn(B, 8, requires_grad=True)
    with count_saved_bytes() as seen:
        y = x * 2  # saves nothing for x (scalar multiply)
        (y[:, :2] * y[:, :2]).sum()  # mul saves its (view) inputs: the storage of y, B*8 floats
    assert sum(seen.values()) == B * 8 * F32


def test_param_bytes_are_exact_per_layer_and_in_total(small_env) -> None:
    from profiler.loader import load_model_file

    for name in ["mlp", "gpt", "unet"]:
        mf = load_model_file(EXAMPLES / f"{name}.py")
        torch.manual_seed(0)
        model = mf.build_model()
        inputs, _ = mf.make_batch(2)
        lg = trace(model, inputs)
        ms = measure_layers(lg, inputs, torch.device("cpu"), warmup=0, repeats=1)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(m.param_bytes for m in ms) == total, name
        for m in ms:
            stage = build_stage(lg, [m.name])
            assert m.param_bytes == sum(p.numel() * p.element_size() for p in stage.parameters())


def test_profile_round_trips_and_bytes_repeat_exactly(small_env) -> None:
    first = profile_model_file(EXAMPLES / "unet.py", 2, warmup=0, repeats=1)
    again = Profile.model_validate(json.loads(first.model_dump_json()))
    assert again == first
    second = profile_model_file(EXAMPLES / "unet.py", 2, warmup=1, repeats=2)
    strip = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms", "optimizer_ms")  # times
    for a, b in zip(first.layers, second.layers, strict=True):
        assert {k: v for k, v in a.model_dump().items() if k not in strip} == \
               {k: v for k, v in b.model_dump().items() if k not in strip}
    assert first.edges == second.edges
    assert first.measured.activation_bytes == second.measured.activation_bytes
    assert first.cut_bytes() == second.cut_bytes()
    assert all(layer.fwd_ms >= 0 and layer.bwd_ms >= 0 for layer in first.layers)
    assert all(layer.bwd_input_ms is not None and layer.bwd_weight_ms is not None
               for layer in first.layers)
    assert sum(layer.fwd_ms + layer.bwd_ms for layer in first.layers) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without a GPU")
def test_cuda_without_gpu_is_a_clear_error(small_env) -> None:
    from planner.errors import PipeplanError

    with pytest.raises(PipeplanError, match="no CUDA device"):
        profile_model_file(EXAMPLES / "mlp.py", 2, device="cuda")


def test_stage_call_overhead_is_measured_on_a_stage_with_a_backward() -> None:
    from profiler.measure import overhead_runner

    run = overhead_runner(torch.device("cpu"))
    assert run.stage.input_keys and not run.stage.input_keys[0].startswith("<input>")
    for _ in range(3):
        run.once(keep=True)
    assert all(b > 0 for b in run.bwd) and all(f > 0 for f in run.fwd)


class _SleepGrad(torch.autograd.Function):
    """Identity whose backward sleeps `ms`."""

    @staticmethod
    def forward(ctx, x, ms):  # noqa: ANN001, ANN205
        ctx.ms = ms
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        import time

        time.sleep(ctx.ms / 1e3)
        return grad, None


class _SplitLayer(nn.Module):
    """The input's gradient waits 30 ms, the weight's 5 ms."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepGrad.apply(x, 30.0) * _SleepGrad.apply(self.w, 5.0)


def test_backward_input_and_weight_are_measured_apart() -> None:
    from profiler.measure import measure_bw_split

    model = nn.Sequential(nn.Linear(4, 4), _SplitLayer())
    x = torch.randn(2, 4)
    lg = trace(model, (x,), granularity="modules")
    split = measure_bw_split(lg, (x,), torch.device("cpu"), warmup=0, repeats=3)
    b, w = split[lg.layer_names()[1]]
    assert b >= 30 and 5 <= w < 25  # each part waits for its own branch only
    b0, w0 = split[lg.layer_names()[0]]
    assert b0 == 0.0 and w0 >= 0  # the model's input needs no gradient: all W


class _LinearThenSlowGrad(nn.Module):
    """The weight joins the input's path before a node whose backward waits 30 ms: the runtime's
    B runs that node once and W starts below it (`runtime.split_backward`)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepGrad.apply(self.fc(x), 30.0)


class _FreesInBackward(torch.autograd.Function):
    """A custom Function whose backward frees what its forward kept: one backward per forward,
    as a training step runs it."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        ctx.keep = x.detach() * 2
        return x * 2

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        out = grad * ctx.keep / ctx.keep
        del ctx.keep
        return out * 2


class _FreesLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FreesInBackward.apply(self.fc(x))


def test_w_is_timed_as_the_runtime_runs_it_not_from_the_outputs_again() -> None:
    """A weight's gradient that passes through the input path's slow node: B waits for it, W
    does not (the profiler timed W as `autograd.grad(outputs, weights)`, which ran the slow node
    a second time and priced B and W at half the backward each); and a Function that frees its
    state in backward is differentiated once per forward."""
    from profiler.measure import measure_bw_split

    model = nn.Sequential(nn.Linear(4, 4), _LinearThenSlowGrad(), _FreesLayer())
    x = torch.randn(2, 4)
    lg = trace(model, (x,), granularity="modules")
    split = measure_bw_split(lg, (x,), torch.device("cpu"), warmup=0, repeats=3)
    b, w = split[lg.layer_names()[1]]
    assert b >= 30 and w < 10, (b, w)
    assert all(p.grad is None for p in model.parameters())  # the profiler's passes keep none


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(x)


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.fc(x))


def test_split_bytes_are_the_gradients_w_waits_for_and_the_saved_inputs() -> None:
    """What a split backward keeps for W (the gradient at each Linear's output) and which of it
    is the layer's own output gradient (a residual layer passes it on unchanged); how much of
    the saved activations is the layer's own input (a Linear saves its input)."""
    from profiler.measure import layer_values, split_bytes

    torch.manual_seed(0)
    x = torch.randn(B, 16)
    one = B * 16 * F32
    for block, output_part in ((Residual(), one), (LinearRelu(), 0)):
        model = nn.Sequential(nn.Linear(16, 16), block)
        lg = trace(model, (x,), granularity="blocks")
        assert lg.layer_names() == ["0", "1"]
        values = layer_values(lg, (x,))
        name = lg.layer_names()[-1]
        got = split_bytes(build_stage(lg, [name]), values)
        assert got.weight_grad_bytes == one
        assert got.weight_grad_output_bytes == output_part
        assert got.saved_input_bytes == one


FEATURES_MODEL = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h0 = self.inp(x)
        return self.out(self.blocks(h0)), h0  # the logits, and features they were computed from


def build_model():
    return Net()


def make_batch(n):
    return (torch.randn(n, 4),), torch.randn(n, 3)


def loss_fn(o, t):
    return nn.functional.mse_loss(o[0], t) + 0.1 * o[1].abs().mean()
'''


def test_a_model_returning_features_its_logits_were_computed_from(tmp_path) -> None:
    """An output that feeds another output (hidden states returned beside the logits): the
    whole-model backward takes the loss's gradient of each output alone, then one backward
    through the model, so every parameter gets exactly the gradient of `loss.backward()`
    (the gradient taken through the model freed its graph: every such model failed to
    profile, "Trying to backward through the graph a second time")."""
    from profiler.measure import WholeRunner

    path = tmp_path / "features.py"
    path.write_text(FEATURES_MODEL)
    profile = profile_model_file(path, 2, warmup=0, repeats=1)
    assert profile.measured.bwd_ms > 0
    ns: dict = {}
    exec(FEATURES_MODEL, ns)
    torch.manual_seed(0)
    model = ns["build_model"]()
    (x,), t = ns["make_batch"](2)
    ns["loss_fn"](model(x), t).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    WholeRunner(model, (x,), t, ns["loss_fn"], torch.device("cpu")).once(keep=True)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=0, atol=1e-7), n


IDENTITY_MODEL = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, active):
        super().__init__()
        self.lin = nn.Linear(512, 512)
        self.active = active

    def forward(self, x):
        return torch.tanh(self.lin(x)) if self.active else x  # inactive: hands its input on


def build_model():
    return nn.Sequential(Block(True), Block(True), Block(False), Block(True), nn.Linear(512, 4))


def make_batch(b):
    return (torch.randn(b, 512),), torch.randn(b, 4)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
'''


def test_a_block_that_returns_its_input_takes_no_backward_from_the_block_before(tmp_path) -> None:
    """The default timing hooks the gradient node of every tensor a layer hands on; a block that
    returns its input unchanged hooked the node of the block before it, and took that block's
    whole backward (0.67 ms against 0.00 for the block that computed it)."""
    path = tmp_path / "identity.py"
    path.write_text(IDENTITY_MODEL)
    profile = profile_model_file(path, batch_size=64, warmup=1, repeats=5, clock="thread", threads=1)
    bwd = {x.name: x.bwd_ms for x in profile.layers}
    assert len(bwd) == 5, bwd
    heavy, identity = bwd[profile.layers[1].name], bwd[profile.layers[2].name]
    assert heavy > 0.05 and identity < 0.2 * heavy, bwd


def test_tensors_several_layers_save_add_up_to_the_whole_models_activations(tmp_path) -> None:
    """Each Linear saves its input, the tanh before it saves the same tensor as its output, and
    a block that hands its input on unchanged passes it to the next: with each tensor several
    layers save counted once (`shared_saved`), the layers add up to what the whole model saves
    (the per-layer sum was 1.75x it)."""
    path = tmp_path / "identity.py"
    path.write_text(IDENTITY_MODEL)
    profile = profile_model_file(path, batch_size=64, warmup=0, repeats=1, threads=1)
    per_layer = sum(x.activation_bytes for x in profile.layers)
    once = per_layer - sum(e.bytes * (len(e.layers) - 1) for e in profile.shared_saved or [])
    assert profile.measured is not None and per_layer > profile.measured.activation_bytes
    assert once == profile.measured.activation_bytes, (per_layer, once, profile.shared_saved)


def test_a_layer_the_user_checkpoints_is_measured_as_one_backward() -> None:
    """A block under the user's own torch.utils.checkpoint recomputes in B and again in W: its
    B + W timed apart cost twice its backward and more (W was 5x its price on a Llama block),
    which ZB-H1 would defer for nothing. It is marked to run whole, as a backward that fails in
    two parts is."""
    from pathlib import Path

    from profiler.loader import load_model_file
    from profiler.measure import measure_bw_split

    model = load_model_file(str(Path(__file__).parents[1] / "runtime" / "models" / "user_checkpoint.py")).build_model()
    x = torch.randn(2, 4)
    lg = trace(model, (x,), granularity="blocks")
    split = measure_bw_split(lg, (x,), torch.device("cpu"), warmup=0, repeats=2)
    kinds = {name: split[name] if isinstance(split[name], str) else "split" for name in lg.layer_names()}
    assert sorted(kinds.values()) == ["recomputes"] * 3 + ["split"] * 2, kinds


_CHANNELS_LAST_SPLIT = """
import json, sys, torch
from profiler.graph import trace
from profiler.loader import load_model_file
from profiler.measure import measure_bw_split
mf = load_model_file(sys.argv[1])
torch.manual_seed(0)
model = mf.build_model()
(x,), _ = mf.make_batch(2)
lg = trace(model, (x,), granularity="blocks")
print(json.dumps(measure_bw_split(lg, (x,), torch.device("cpu"), warmup=0, repeats=1)))
"""


def test_groupnorm_on_channels_last_inputs_is_measured_split() -> None:
    """Conv + GroupNorm blocks in channels_last: timing W asked GroupNorm for its weight's
    gradient alone, which segfaults in torch 2.13 (`planner profile` exited 139 with no
    message). Measured in a subprocess (a crash would end pytest): each block gets a B and a W."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    model = root / "tests" / "runtime" / "models" / "channels_last_groupnorm.py"
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _CHANNELS_LAST_SPLIT, str(model)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=root)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    split = json.loads(proc.stdout.splitlines()[-1])
    blocks = [name for name in split if name.startswith("blocks.")]
    assert len(blocks) == 3 and all(isinstance(split[n], list) and split[n][1] > 0 for n in blocks), split
