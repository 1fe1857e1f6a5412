"""The user's code runs as written: blocks are called, not traced; at finer granularities a
module whose inside cannot be traced faithfully (a custom autograd Function, hooks) is kept
whole with a warning naming it; --split-points groups blocks into layers."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from profiler_helpers import ROOT, run_pipeline
from torch import nn

from planner.errors import PipeplanError
from planner.formats import Profile
from planner.io import load_model
from profiler.graph import build_stage, trace
from profiler.tracing import TracingWarning


class STE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):  # noqa: ANN001, ANN205
        return g


class QuantLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return STE.apply(self.lin(x) * 3)


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.register_forward_hook(lambda m, a, out: out * 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.lin(x))


def _net() -> nn.Module:
    return nn.Sequential(Plain(), QuantLinear(), Hooked(), Plain())


def _check_equal(model_fn, granularity: str) -> list[str]:
    torch.manual_seed(0)
    ref = model_fn()
    torch.manual_seed(0)
    model = model_fn()
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ref_out = ref(x)
    nn.functional.mse_loss(ref_out, y).backward()
    lg = trace(model, (x,), granularity)
    names = lg.layer_names()
    out, _, stages = run_pipeline(lg, [[n] for n in names], (x,), y, nn.functional.mse_loss)
    assert torch.equal(out, ref_out)
    grads = {k: p.grad for k, p in ref.named_parameters()}
    for st in stages.values():
        for k, p in st.named_parameters():
            assert (p.grad is None and grads[k] is None) or torch.equal(p.grad, grads[k]), k
    return names


def test_blocks_are_called_not_traced_and_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        names = _check_equal(_net, "blocks")
    assert names == ["0", "1", "2", "3"]
    model = _net()
    lg = trace(model, (torch.randn(2, 8),))
    assert build_stage(lg, ["1"]).get_submodule("1") is model[1]


def test_finer_granularity_keeps_opaque_modules_whole_with_a_warning():
    with pytest.warns(TracingWarning) as caught:
        names = _check_equal(_net, "modules")
    text = " ".join(str(w.message) for w in caught)
    assert "1 (QuantLinear)" in text and "autograd.Function STE" in text
    assert "2 (Hooked)" in text and "hooks" in text
    assert "0 (Plain)" not in text
    # the plain modules are split into their leaves, the opaque ones are one layer each
    assert names == ["0.lin", "0.act", "1", "2", "3.lin", "3.act"]
    with pytest.warns(TracingWarning):
        assert _check_equal(_net, "depth:2") == ["0.lin", "0.act", "1", "2", "3.lin", "3.act"]


def test_split_points_group_blocks():
    model = nn.Sequential(*(Plain() for _ in range(6)))
    lg = trace(model, (torch.randn(2, 8),), "split:2,4")
    assert lg.layer_names() == ["0+1", "2+3", "4+5"]
    with pytest.raises(PipeplanError, match="no module 'nope'"):
        trace(model, (torch.randn(2, 8),), "split:nope")
    with pytest.raises(PipeplanError, match="inside the block '2'"):
        trace(model, (torch.randn(2, 8),), "split:2.lin")


def test_profile_cli_split_points(tmp_path):
    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "planner", "profile", str(ROOT / "examples" / "sleep.py"),
                        "--batch-size", "2", "--warmup", "0", "--repeats", "1", "--split-points",
                        "blocks.2", "-o", str(out)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**__import__("os").environ, "PIPEPLAN_SLEEP_MS": "0"})
    assert r.returncode == 0, r.stderr
    profile = load_model(out, Profile)
    assert [x.name for x in profile.layers] == ["inp+blocks.0+blocks.1", "blocks.2+blocks.3"]
    assert profile.granularity == "split:blocks.2"
    r = subprocess.run([sys.executable, "-m", "planner", "profile", str(ROOT / "examples" / "sleep.py"),
                        "--split-points", "blocks.9", "-o", str(out)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "no module 'blocks.9'" in r.stderr and "Traceback" not in r.stderr


def test_hooks_on_a_module_holding_blocks_are_reported():
    model = nn.Sequential(Plain(), Plain(), Plain())
    model.register_forward_hook(lambda m, a, out: out)
    with pytest.warns(TracingWarning, match="the model .Sequential. has hooks"):
        lg = trace(model, (torch.randn(2, 8),))
    assert lg.layer_names() == ["0", "1", "2"]  # still split at its blocks


@pytest.mark.parametrize("kind", ["forward", "pre"])
def test_hooks_on_a_module_holding_blocks_that_change_values_are_refused(kind: str) -> None:
    """No stage calls the model whole, so its hooks do not run in a pipeline: one that changes
    the output or the input would train something else than the model, silently (one that only
    looks, as in the test above, is still only warned about)."""
    model = nn.Sequential(Plain(), Plain(), Plain())
    if kind == "forward":
        model.register_forward_hook(lambda m, a, out: 2 * out)
    else:
        model.register_forward_pre_hook(lambda m, a: (a[0] + 1,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PipeplanError, match="hooks on the model change what it computes"):
            trace(model, (torch.randn(2, 8),))


class RootSTE(nn.Module):
    """Applies a custom Function in its own forward, between two blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Plain(), Plain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(STE.apply(self.a(x)))


def test_a_custom_function_in_the_models_own_forward_is_a_clear_error() -> None:
    # no module to call whole there, and torch.export would drop the Function's backward
    with pytest.raises(PipeplanError, match="applies a custom autograd.Function STE itself.*submodule"):
        trace(RootSTE(), (torch.randn(2, 8),))


class Frozen(nn.Module):
    """Runs its first linear without gradients (a frozen adapter)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            h = self.lin(x)
        return torch.tanh(self.out(h + x))


class LowPrecision(nn.Module):
    """Its linear under autocast to bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.lin(x)
        return torch.tanh(h.float())


def test_grad_mode_and_autocast_inside_a_module_keep_it_whole_with_a_warning():
    """fx records the ops inside `with torch.no_grad()` / `torch.autocast(...)` and drops the
    context: traced into, those modules would train their frozen part, in full precision."""
    with pytest.warns(TracingWarning) as caught:
        names = _check_equal(lambda: nn.Sequential(Plain(), Frozen(), LowPrecision(), Plain()), "modules")
    text = " ".join(str(w.message) for w in caught)
    assert "1 (Frozen)" in text and "2 (LowPrecision)" in text and "grad-mode or autocast" in text
    assert names == ["0.lin", "0.act", "1", "2", "3.lin", "3.act"]


class RootContext(nn.Module):
    def __init__(self, context: str) -> None:
        super().__init__()
        self.a, self.b, self.context = Plain(), Plain(), context

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context == "no_grad":
            with torch.no_grad():
                x = self.a(x)
        else:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                x = self.a(x)
        return self.b(x.float())


@pytest.mark.parametrize("context", ["no_grad", "autocast"])
def test_grad_mode_or_autocast_in_the_models_own_forward_is_a_clear_error(context: str) -> None:
    with pytest.raises(PipeplanError, match="enters a grad-mode or autocast context.*small nn.Module"):
        trace(RootContext(context), (torch.randn(2, 8),))
    # the context restored: tracing changed neither grad mode nor autocast
    assert torch.is_grad_enabled() and not torch.is_autocast_enabled("cpu")


class _Blk(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class CountsInItsOwnForward(nn.Module):
    """Updates buffers in its own forward with operations on them alone: torch.fx runs those
    once while tracing and records nothing (found by an outside check: the counter stayed 0 and
    the moving average lost its decay in pipeline training, silently)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Blk() for _ in range(2)])
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        x = self.blocks[0](x)
        self.ema.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.blocks[1](x)


class StepsInItsOwnForward(nn.Module):
    """Keeps a Python step counter in its own forward and branches on it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Blk() for _ in range(2)])
        self.n = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n += 1
        x = self.blocks[0](x)
        if self.n % 2 == 0:
            x = x * 2.0
        return self.blocks[1](x)


def test_state_the_models_own_forward_changes_outside_the_graph_is_refused_or_warned() -> None:
    model = CountsInItsOwnForward()
    with pytest.raises(PipeplanError, match="changes calls, ema in place outside any layer"):
        trace(model, (torch.randn(2, 8),))
    stepping = StepsInItsOwnForward()
    with pytest.warns(TracingWarning, match=r"n \(a Python attribute of StepsInItsOwnForward\) changed"):
        trace(stepping, (torch.randn(2, 8),))
    assert stepping.n == 0  # tracing leaves the model as it was


class KeepsTheLength(nn.Module):
    """Sets attributes from traced values in its own forward (a cache of the sequence length,
    a tensor kept for inspection): while tracing they are Proxies, which cannot be compared."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Blk() for _ in range(2)])
        self.seq_len = 0
        self.last = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seq_len = x.shape[0]
        x = self.blocks[0](x)
        self.last = x
        return self.blocks[1](x)


class _CountingHead(nn.Module):
    """Counts its calls in a buffer, then branches on the data: fx cannot trace it, so it is
    called whole (a leaf), and its count runs on every step as written."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.add_(1)
        if x.sum() > 0:
            return self.lin(x)
        return -self.lin(x)


class WithCountingHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Blk() for _ in range(2)])
        self.head = _CountingHead()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_traced_values_in_attributes_and_a_retried_leaf_are_not_refused() -> None:
    """Found by a review: an attribute set to a traced value crashed the comparison, and a
    module made a leaf after a failed attempt was refused for the count that attempt ran."""
    model = KeepsTheLength()
    with pytest.warns(TracingWarning, match=r"seq_len .* changed while tracing \(0 -> a Proxy\)"):
        trace(model, (torch.randn(2, 8),))
    assert model.seq_len == 0 and model.last is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TracingWarning)  # the head is kept whole, with a warning
        lg = trace(WithCountingHead(), (torch.randn(2, 8),))
    assert lg.layer_names()


def test_forward_hooks_on_a_container_split_between_stages_are_traced_not_lost() -> None:
    """A forward hook on a Sequential of blocks inside the model: tracing calls the container
    through Module.__call__, so the hook's tensor operations are in the graph (a pipeline run
    matched one process with a hook that doubles the output); the warning said they did not
    run."""
    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(Plain(), Plain(), Plain())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.blocks(x)

    model = Outer()
    model.blocks.register_forward_hook(lambda m, a, out: 2 * out)
    with pytest.warns(TracingWarning, match="hooks were traced into the graph") as seen:
        lg = trace(model, (torch.randn(2, 8),))
    assert not any("do not run" in str(w.message) for w in seen)
    assert lg.layer_names() == ["blocks.0", "blocks.1", "blocks.2"]


class _Twin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.tanh(self.lin(x))
        return y, y * 2


class _Sum(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        s = 0
        for a in args:
            s = s + a
        return self.lin(s)


class StarUnpacked(nn.Module):
    """Hands a block's tuple straight into the next block: `b(*a(x))`."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Twin(), _Sum()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](*self.layers[0](x))


def test_a_graph_export_gets_wrong_says_what_stopped_fx() -> None:
    # the error listed hooks, Python numbers and side effects the model does not have; what
    # fx stopped at (a block's output unpacked as *args) is the thing to change
    with pytest.raises(PipeplanError, match=r"torch.fx stopped at: TraceError: Proxy object cannot be iterated"):
        trace(StarUnpacked(), (torch.randn(2, 8),))


class Untraceable(nn.Module):
    """Holds blocks, but torch.fx cannot trace its forward (control flow on a tensor's value,
    as in a Hugging Face model): the trace calls it whole."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Plain() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 1e9:
            x = x * 0
        for b in self.blocks:
            x = b(x)
        return x


class Wrapped(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Untraceable()
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_a_module_holding_blocks_traced_whole_is_a_layer_under_its_own_name():
    """An outside review wrapped GPT2LMHeadModel in a module of its own: fx traced the GPT-2
    body whole, and at the blocks granularity it went into the head's layer as glue, the whole
    model in one layer named "lm.lm_head" (kind Linear); --split-points on a decoder block said
    it "never runs in the model's forward"."""
    with pytest.warns(TracingWarning, match="inner"):
        names = _check_equal(Wrapped, "blocks")
    assert names == ["inner", "head"]
    with pytest.warns(TracingWarning), pytest.raises(
            PipeplanError, match=r"'inner.blocks.1' runs inside inner, which is traced as one piece"):
        trace(Wrapped(), (torch.randn(2, 8),), "split:inner.blocks.1")


class ShapeBranch(nn.Module):
    """Holds blocks; its forward branches on a shape, which torch.fx cannot trace and
    torch.export (specialising on shapes) can."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Plain() for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 1000:
            x = x[:1000]
        for b in self.blocks:
            x = b(x)
        return x


class WrappedExportable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = ShapeBranch()
        self.head = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


def test_blocks_inside_a_module_fx_calls_whole_are_layers_where_export_keeps_them():
    """The wrapped model that fx can trace only by calling its body whole: torch.export keeps
    the body's blocks as calls, checked against the model, so stages can start at each (a
    wrapped GPT2LMHeadModel profiles as embeddings, one layer per decoder block, norm + head),
    and fx's warning about the body is not given."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TracingWarning)
        names = _check_equal(WrappedExportable, "blocks")
    assert names == ["inner.blocks.0", "inner.blocks.1", "inner.blocks.2", "head"]
