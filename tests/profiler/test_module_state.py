"""The state a block's forward may change, kept and put back (`profiler.module_state`): what a
recomputation and the trace rely on, checked against the module's own objects and values."""

from __future__ import annotations

import torch
from torch import nn

from profiler.module_state import SMALL_TENSOR_BYTES, BlockState


class Lists(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(4, 4))
        self.w1 = nn.Parameter(torch.randn(4, 4))
        self.experts = [self.w0, self.w1]
        self.rnn = nn.LSTM(4, 4)
        big = SMALL_TENSOR_BYTES // 4 + 1  # float32 elements: one more than a small tensor holds
        self.cache = {"big": torch.zeros(big), "calls": 0}
        self.hist: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache["calls"] += 1
        if self.cache["calls"] > 1:  # changed in place from the second forward on only
            self.cache["big"].add_(1.0)
        self.hist.append(x.detach().sum())
        return x + sum(x @ w for w in self.experts) + self.rnn(x.unsqueeze(0))[0][0]


def test_put_back_keeps_the_modules_own_tensors_and_their_values() -> None:
    """A list of the module's parameters (and an LSTM's `_flat_weights`) holds the very
    parameters after a restore (copies were put back: the forward then read weights the optimizer
    never moved); a large tensor in a dict that a later forward first changes in place comes back
    with its values (no error: a container's tensors are copied at every capture)."""
    torch.manual_seed(0)
    m = Lists()
    state = BlockState(m)
    x = torch.randn(3, 4)
    first = state.capture()
    m(x)
    state.learn(first)
    snap = state.capture()
    big = m.cache["big"]
    m(x)  # changes cache["big"] in place for the first time
    assert float(big.sum()) == big.numel()
    state.restore(snap)
    assert m.experts[0] is m.w0 and m.experts[1] is m.w1
    assert all(a is b for a, b in zip(m.rnn._flat_weights, [m.rnn.weight_ih_l0, m.rnn.weight_hh_l0,
                                                            m.rnn.bias_ih_l0, m.rnn.bias_hh_l0], strict=True))
    assert m.cache["big"] is big and float(big.sum()) == 0.0 and m.cache["calls"] == 1
    assert len(m.hist) == 1


def test_a_view_of_a_large_buffer_in_a_dict_does_not_move_the_buffer() -> None:
    """Views of a large buffer kept in a dict (rotary tables as `{"k": self.table[0]}`), nothing
    changed by the forward: written back at every restore, a view moved the buffer's version and
    the next restore took the buffer for one a later forward had changed (a review of the first
    version of the container copies). The sequence `runtime.recompute` runs: two forwards in
    flight, then each one's recomputation."""

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.randn(2, 1 << 16))  # 512 kB
            self.rows = {"k": self.table[0], "v": self.table[1, :8]}  # a large and a small view

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.rows["k"][: x.shape[-1]] + self.rows["v"][: x.shape[-1]]

    m, x = M(), torch.randn(3, 4)
    state = BlockState(m)
    snaps = []
    for _ in range(2):
        snap = state.capture()
        m(x)
        state.learn(snap)
        snaps.append(snap)
    version = m.table._version
    for snap in snaps:
        now = state.capture(every=True)
        state.restore(snap)
        m(x)
        state.restore(now)
    assert m.table._version == version


def test_a_frozen_parameter_first_changed_through_data_later_is_refused_not_kept_wrong() -> None:
    """MoCo initialises its key encoder as a copy of the query encoder, so the first forwards
    leave it as it is; once the query moves, each forward moves the key through `.data` (no
    version moves). A snapshot taken before that was seen has no copy of the larger key: putting
    it back stops with the recomputation's error (the key's fingerprint moved), never leaves the
    recomputation on the moved key; the snapshots after it keep a copy and put it back."""
    import pytest

    from planner.errors import PipeplanError

    n = SMALL_TENSOR_BYTES // 4 + 16  # float32 elements: a larger tensor

    class Momentum(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Parameter(torch.randn(n))
            self.k = nn.Parameter(self.q.detach().clone(), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.k.data.mul_(0.5).add_(self.q.data, alpha=0.5)
            return x * self.q[:4] + self.k[:4]

    m, x = Momentum(), torch.randn(3, 4)
    state = BlockState(m)
    for _ in range(2):  # the key equals the query: unchanged
        snap = state.capture()
        m(x)
        state.learn(snap)
    with torch.no_grad():
        m.q.add_(1.0)  # an optimizer step
    before = m.k.detach().clone()
    first = state.capture()
    m(x)  # moves the key for the first time
    state.learn(first)
    second = state.capture()
    m(x)
    state.learn(second)
    with pytest.raises(PipeplanError, match="changed Momentum.k .* for the first time"):
        state.restore(first, stand_in=True)
    after_first = before * 0.5 + m.q.detach() * 0.5
    key, now_values = m.k, m.k.detach().clone()
    now = state.capture(every=True)  # as `runtime.recompute` runs a recomputation
    state.restore(second, stand_in=True)
    assert m.k is not key and torch.equal(m.k, after_first)  # the key as the second forward found it
    m(x)  # the recomputation moves the stand-in, not the key
    state.restore(now)
    assert m.k is key and torch.equal(m.k, now_values)


def test_a_recomputation_saves_a_stand_in_of_a_frozen_parameter_not_the_parameter() -> None:
    """An EMA teacher: a frozen Linear whose weight each forward moves in place, and the
    gradient flows through its input, so the Linear saves its weight. A recomputation ran on
    the weight written back in place, and the restore after it wrote the current weight into
    that same tensor: the backward used the later weight (0.02 off one process; an outside
    review). The recomputation now saves a stand-in holding the values its forward found."""
    n = SMALL_TENSOR_BYTES // 4 + 16

    class Teacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(n), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * self.w[:4]  # saves the weight (x needs a gradient)
            with torch.no_grad():
                self.w.mul_(0.5).add_(1.0)
            return y

    from torch.utils.checkpoint import checkpoint

    m = Teacher()
    state = BlockState(m)
    x = torch.randn(3, 4, requires_grad=True)
    w0 = m.w.detach()[:4].clone()

    def run(found):  # (runtime.recompute's run_block, reduced)
        if torch._C._current_graph_task_id() == -1:
            out = m(x)
            state.learn(found)
            return out
        now = state.capture(every=True)
        state.restore(found, stand_in=True)
        try:
            return m(x)
        finally:
            state.restore(now)

    y = checkpoint(run, state.capture(), use_reentrant=False)
    m(x.detach())  # a later microbatch's forward moves the weight again
    y.sum().backward()
    assert torch.equal(x.grad, w0.expand(3, 4))  # the weight the forward read
