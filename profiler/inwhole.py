"""Time every layer inside whole forward and backward passes (the default layer timing).

The model's traced graph runs in one piece, as the model does, with a timestamp wherever
execution moves from one layer's nodes to another's (forward), and a gradient hook on every
tensor a layer hands to another (backward: the hook fires when that tensor's gradient is
complete, i.e. when the engine moves into the backward of the layer that produced it). A layer's
time is the sum of the intervals it was current. Layers therefore add up to the whole pass —
the per-call costs of Python, module calls and the autograd engine are paid where they occur
and attributed to the layer that causes them — instead of every layer timed alone paying (or
having subtracted) a fixed per-call cost, which under-counts layers of a few tens of µs.

On CUDA the timestamps are CUDA events (read after a synchronisation); on CPU `perf_counter`
(or the thread's CPU time with `clock="thread"`: CPU autograd runs on the calling thread).
The blocks are the user's own modules (`call_module` nodes), called as in training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from profiler.graph import LayerGraph


def _noop(*_: Any) -> None:
    return None


def _register(t: torch.Tensor, fn: Callable[..., None]) -> None:
    """Call `fn` when the gradient of `t` is complete (a pre-hook of the node that produced t:
    cheaper than `Tensor.register_hook`)."""
    if t.grad_fn is not None:
        t.grad_fn.register_prehook(fn)
    else:
        t.register_hook(fn)


def _caller(module: torch.nn.Module) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)
    call.__name__ = "call_" + type(module).__name__
    return call


class _Clock:
    def __init__(self, device: torch.device, clock: str) -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if clock == "thread" else time.perf_counter

    def mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def ms(self, marks: list[Any]) -> list[float]:
        """Milliseconds of every mark after the first (relative to it)."""
        if self.cuda:
            torch.cuda.synchronize()
            return [float(marks[0].elapsed_time(m)) for m in marks]
        return [(m - marks[0]) * 1e3 for m in marks]


def _instrumented(lg: LayerGraph, fwd: Callable[[int], None], hook: Callable[[Any, int], Any]
                  ) -> fx.GraphModule:
    """lg's whole graph with `fwd(i)` where execution enters layer i and `hook(value, i)`
    around every value layer i hands to another layer (or returns)."""
    gm = lg.gm
    boundary: dict[str, int] = {}
    for i, needed in enumerate(lg.layer_needs):
        for name in needed:
            if name in lg.owner and lg.owner[name] != i:
                boundary[name] = lg.owner[name]
    output = next(n for n in gm.graph.nodes if n.op == "output")
    for a in output.all_input_nodes:
        if a.name in lg.owner and lg.kind.get(a.name) == "value":
            boundary.setdefault(a.name, lg.owner[a.name])
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    current = -1
    for node in gm.graph.nodes:
        if node.op == "output":
            g.call_function(fwd, (len(lg.layers),))
            g.output(fx.map_arg(node.args[0], lambda a: env[a]))
            continue
        layer = lg.owner.get(node.name)
        if node.op not in ("placeholder", "get_attr") and layer is not None and layer != current:
            g.call_function(fwd, (layer,))
            current = layer
        if node.op == "call_module":  # called directly: no attribute lookups per call
            new = g.call_function(_caller(lg.root.get_submodule(str(node.target))),
                                  fx.map_arg(node.args, lambda a: env[a]),
                                  fx.map_arg(node.kwargs, lambda a: env[a]))
        else:
            new = g.node_copy(node, lambda a: env[a])
        if node.name in boundary:
            new = g.call_function(hook, (new, boundary[node.name]))
        env[node] = new
    return fx.GraphModule(lg.root, g, "Instrumented")


class InWholeRunner:
    """Each `once()`: the whole graph forward, loss gradient w.r.t. the output, backward."""

    def __init__(self, lg: LayerGraph, inputs: tuple[torch.Tensor, ...], device: torch.device,
                 clock: str = "wall") -> None:
        self.n = len(lg.layers)
        self.inputs = inputs
        self.clock = _Clock(device, clock)
        self._f: list[tuple[int, Any]] = []
        self._b: list[tuple[int, Any]] = []
        self.fwd: list[list[float]] = []  # per run, per layer
        self.bwd: list[list[float]] = []

        def fwd_mark(i: int) -> None:
            self._f.append((i, self.clock.mark()))

        marks = [self._b_mark(i) for i in range(self.n)] + [_noop]  # the last: calibration
        self.hooks = [0] * (self.n + 1)  # hook calls made by layer i's forward, per pass

        # the layer that marks each gradient node this pass: a layer handing on a tensor it was
        # given (a block that returns its input) hooks the node of the layer that made it, and
        # would take that layer's backward; the nodes are held so their ids stay theirs
        self._marked: dict[int, tuple[int, Any]] = {}

        def hook(value: Any, i: int) -> Any:
            self.hooks[i] += 1
            for t in (value,) if isinstance(value, torch.Tensor) else pytree.tree_leaves(value):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    node = t.grad_fn if t.grad_fn is not None else t
                    if self._marked.setdefault(id(node), (i, node))[0] == i:
                        _register(t, marks[i])
            return value

        self._hook = hook
        self._fwd_mark = fwd_mark

        self._probe = torch.ones(1, device=device, requires_grad=True)
        self.gm = _instrumented(lg, fwd_mark, hook)
        self.gm.train(lg.root.training)
        self.params = [p for p in self.gm.parameters() if p.requires_grad]

    def _b_mark(self, i: int) -> Callable[..., None]:
        def mark(*_: Any) -> None:
            self._b.append((i, self.clock.mark()))
        return mark

    def _costs_ms(self) -> tuple[float, float]:
        """What one hook call (registering a gradient hook) and one forward mark cost: the
        instrumentation's own time, which falls between the marks and is taken out again
        (CPU clocks only: on CUDA the marks time the GPU's work)."""
        if self.clock.cuda:
            return 0.0, 0.0
        probes = [self._probe * 1.0 for _ in range(16)]
        t0 = self.clock.now()
        for t in probes:
            self._hook(t, self.n)
        t1 = self.clock.now()
        for _ in probes:
            self._fwd_mark(self.n)
        t2 = self.clock.now()
        del self._f[-len(probes):]
        return (t1 - t0) * 1e3 / len(probes), (t2 - t1) * 1e3 / len(probes)

    def _fire_cost_ms(self) -> float:
        """What one gradient hook costs when it fires in backward (CPU clocks only): a chain
        of 16 cheap ops run backward with and without a marking hook on each."""
        if self.clock.cuda:
            return 0.0
        spent = []
        for hooked in (False, True, False, True):
            h = self._probe
            for _ in range(16):
                h = h * 1.0
                if hooked:
                    _register(h, self._b_mark(self.n))
            t0 = self.clock.now()
            h.backward()
            spent.append(self.clock.now() - t0)
        self._b.clear()
        self._probe.grad = None
        return max(0.0, (spent[1] + spent[3] - spent[0] - spent[2]) / 2 * 1e3 / 16)

    def once(self, keep: bool) -> None:
        self._f.clear()
        self._b.clear()
        hook_ms, mark_ms = self._costs_ms()
        fire_ms = self._fire_cost_ms()
        self.hooks = [0] * (self.n + 1)
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()
        self._marked.clear()  # (the probes above are gone: their ids may be reused)
        out = self.gm(*self.inputs)
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
        grads = [torch.ones_like(t) for t in leaves]
        start = self.clock.mark()
        if leaves:
            torch.autograd.backward(leaves, grads)
        end = self.clock.mark()
        self._marked.clear()
        if keep:
            fwd = self._attribute(self._f)
            entered = [0] * (self.n + 1)
            for i, _ in self._f:
                entered[i] += 1
            self.fwd.append([max(0.0, f - h * hook_ms - e * mark_ms)
                             for f, h, e in zip(fwd, self.hooks, entered, strict=False)])
            marks = [(self.n - 1, start), *self._b, (-1, end)]
            fired = [0] * (self.n + 1)
            for i, _ in self._b:
                fired[i] += 1
            bwd = self._attribute(marks)
            self.bwd.append([max(0.0, b - k * fire_ms) for b, k in zip(bwd, fired, strict=False)])

    def _attribute(self, marks: list[tuple[int, Any]]) -> list[float]:
        """Time between consecutive marks goes to the layer of the earlier one."""
        out = [0.0] * self.n
        if len(marks) < 2:
            return out
        ms = self.clock.ms([m for _, m in marks])  # (marks are in time order)
        for (i, _), t0, t1 in zip(marks, ms, ms[1:], strict=False):
            if 0 <= i < self.n:
                out[i] += t1 - t0
        return out

    def zero(self) -> None:
        for p in self.params:
            p.grad = None
