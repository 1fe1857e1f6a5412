"""B and W apart (runtime.split_backward) give the gradients of one backward: inputs' from B,
weights' from W, on graphs where weights reach the outputs by the input path, by branches of
their own, or both (independent reference: one `torch.autograd.backward`)."""

from __future__ import annotations

import pytest
import torch

from runtime.split_backward import backward_input, backward_weight

CASES = {
    "weight on the input path": lambda x, g, w: ((x @ w) * g,),
    "and returned on its own": lambda x, g, w: (x * g, g.expand(2, -1)),
    "both through a linear": lambda x, g, w: ((x @ w) * g, g.expand(2, -1)),
    "its own branch computed on": lambda x, g, w: (torch.tanh(x * g), g.expand(2, -1) * 2),
    "its own branch also used on the path": lambda x, g, w: (x * g.expand(2, -1), g.expand(2, -1).exp()),
    "views on the path": lambda x, g, w: ((x * g).view(2, 2, 2).transpose(1, 2).reshape(2, 4), g.sum()),
    "a weight on no input path": lambda x, g, w: (x * g, w.sum(0, keepdim=True)),
    "two weights, one output of their own": lambda x, g, w: (x @ w, (g @ w).expand(2, -1)),
    "outputs of one op of their own": lambda x, g, w: (x * g, *(g * 3).expand(2, -1).chunk(2)),
    # w meets the input path at two nodes, one shared with g: torch's get_param_groups left w in
    # two groups about half the time (its merge depends on a set's order), w's gradient twice
    "a weight at two joins, one shared": lambda x, g, w: (torch.tanh(x) * (g @ w), torch.tanh(x) @ w),
}


def _grads(fn, split: bool):
    torch.manual_seed(0)
    g = torch.nn.Parameter(torch.rand(1, 4) + 0.5)
    w = torch.nn.Parameter(torch.randn(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    outs = fn(x, g, w)
    gos = [torch.randn_like(o) for o in outs]
    if split:
        (gx,), pending = backward_input(outs, gos, [x], [g, w])
        backward_weight(pending, [g, w])
    else:
        torch.autograd.backward(outs, gos)
        gx = x.grad
    return gx, g.grad, w.grad


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("trial", range(10))  # (the groups' order was a set's: each trial anew)
def test_b_and_w_apart_give_one_backwards_gradients(case: str, trial: int) -> None:
    for whole, split in zip(_grads(CASES[case], False), _grads(CASES[case], True), strict=True):
        if whole is None:
            assert split is None or not split.abs().max(), case
        else:
            assert split is not None and torch.allclose(whole, split, atol=1e-6), (case, whole, split)


def test_a_block_the_user_checkpoints_recomputes_once_in_w() -> None:
    """A block under the user's own torch.utils.checkpoint recomputes in B; W by groups was one
    backward per weight group, each recomputing again (a Llama block's projections ran 11 times
    in one forward + B + W). B now says it recomputes and W takes every weight in one call from
    the outputs: one recomputation more, and the gradients of one backward."""
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.c(torch.tanh(self.a(x)) * torch.sigmoid(self.b(x))) + x

    torch.manual_seed(0)
    block = Block()
    calls = [0]
    block.a.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    weights = list(block.parameters())

    def grads(split: bool):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).requires_grad_()
        for w in weights:
            w.grad = None
        calls[0] = 0
        out = checkpoint(block, x, use_reentrant=False)  # (a reentrant one refuses autograd.grad)
        if not split:
            out.sum().backward()
            return x.grad, [w.grad.clone() for w in weights], calls[0], None
        (gx,), pending = backward_input([out], [torch.ones_like(out)], [x], weights)
        backward_weight(pending, weights)
        return gx, [w.grad.clone() for w in weights], calls[0], pending

    gx, gw, n_whole, _ = grads(False)
    sx, sw, n_split, pending = grads(True)
    assert torch.allclose(gx, sx) and all(torch.allclose(a, b) for a, b in zip(gw, sw, strict=True))
    assert pending.recomputes and n_whole == 2 and n_split == 3  # forward, B's and W's recomputation


# B then W of conv + GroupNorm in a subprocess (torch 2.13 segfaults where W asks GroupNorm on a
# channels_last input for its weight's gradient alone): prints the largest difference from one
# backward and how many GroupNorm input edges W also asked for
_GROUPNORM = """
import sys, torch
from runtime.split_backward import backward_input, backward_weight
layout, direct, norm_first = sys.argv[1], sys.argv[2] == "direct", sys.argv[3] == "norm_first"
fmt = torch.channels_last if layout == "channels_last" else torch.contiguous_format
torch.manual_seed(0)
conv, norm = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.GroupNorm(2, 8)
layers = [norm, conv] if norm_first else [conv, norm]
block = torch.nn.Sequential(*layers).to(memory_format=fmt)
weights = list(block.parameters())
x = torch.randn(2, 8, 6, 6).contiguous(memory_format=fmt).requires_grad_()
g = torch.randn(2, 8, 6, 6)
torch.autograd.backward([block(x)], [g])
whole = [x.grad, *(w.grad.clone() for w in weights)]
for w in weights:
    w.grad = None
(gx,), pending = backward_input([block(x)], [g], [x], weights, direct=direct)
edges = len({(id(e.node), e.output_nr) for es in getattr(pending, "norm_edges", {}).values() for e in es})
backward_weight(pending, weights)
split = [gx, *(w.grad for w in weights)]
print(max(float((a - b).abs().max()) for a, b in zip(whole, split, strict=True)), edges)
"""


def _groupnorm_split(*args: str) -> tuple[float, int]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", _GROUPNORM, *args], capture_output=True,
                          text=True, timeout=120, env=env, cwd=root)
    assert proc.returncode == 0, (args, proc.returncode, proc.stderr[-2000:])
    diff, edges = proc.stdout.split()
    return float(diff), int(edges)


@pytest.mark.parametrize("direct", ["groups", "direct"])
@pytest.mark.parametrize("order", ["conv_first", "norm_first"])
def test_groupnorm_on_a_channels_last_input_splits_without_crashing(direct: str, order: str) -> None:
    """W asked GroupNorm for its weight's and bias's gradients without its input's: torch 2.13
    segfaults there on a channels_last input (the profiler exited 139, a ZB-H1 rank died of
    signal 11). W now also asks for the gradient at the GroupNorm's input edge, which it drops:
    the gradients are one backward's, by groups and from the outputs (a recomputed stage), with
    the GroupNorm after a conv or on the stage's input itself."""
    diff, edges = _groupnorm_split("channels_last", direct, order)
    assert diff < 1e-5 and edges == 1


@pytest.mark.parametrize("direct", ["groups", "direct"])
def test_groupnorm_on_a_contiguous_input_asks_for_no_more(direct: str) -> None:
    """A contiguous input is safe: W asks GroupNorm for its weights' gradients alone, as before
    (no input gradient computed again)."""
    diff, edges = _groupnorm_split("contiguous", direct, "conv_first")
    assert diff < 1e-5 and edges == 0
