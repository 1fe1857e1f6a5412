"""Measure layers and whole models on one device: times, parameter and activation bytes.

- times: median over `repeats` runs after `warmup` runs, layers and whole model interleaved
  round by round; on CPU with `time.perf_counter` (or the thread's CPU time, see `Timer`), on
  CUDA with CUDA events (synchronised). By default (`layer_timing="in-whole"`) every layer is
  timed inside whole forward and backward passes of the traced model (`profiler.inwhole`), so
  per-call costs land on the layers that cause them and the layers add up to the whole model.
  With `layer_timing="isolated"` each layer runs alone as its own stage; the fixed cost of
  calling a stage and starting its backward (measured on a stage that does nothing, see
  `overhead_runner`) is then subtracted from every layer (`subtract_overhead`): the whole model
  pays it once, a sum over L layers would pay it L times. The stage overhead is measured and
  reported either way (a pipeline stage pays it once per microbatch).
  Gradients stay allocated and are zeroed in place
  before every run (freshly allocated gradients would add page-fault time that depends on
  how much the allocator happens to return to the system, not on the layer).
- `param_bytes`: `sum(p.numel() * p.element_size())` over the layer's parameters (buffers are
  reported separately as `buffer_bytes`).
- `activation_bytes`: the bytes autograd keeps for backward, measured with
  `torch.autograd.graph.saved_tensors_hooks`: every saved tensor's storage counted once (a view
  keeps its whole storage alive). Parameters and buffers are excluded: they are not per
  microbatch and are already counted in `param_bytes`/`buffer_bytes`.
- `output_bytes`: bytes of the tensors the layer hands to other layers (for the last layer,
  the model's output).
Each layer runs as `profiler.graph.build_stage(layer_graph, [name])` on the values the
preceding layers produced, so what is measured is what a pipeline stage executes.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from planner.errors import PipeplanError
from planner.formats import INPUT_NODE
from profiler.graph import LayerGraph, StageModule, build_stage, input_key
from profiler.inwhole import InWholeRunner


def library_workspace_bytes(device: torch.device) -> int:
    """Bytes the CUDA libraries keep in PyTorch's allocator for as long as the process runs,
    beyond any tensor: cuBLAS keeps a workspace per thread and stream (32 MiB each on Hopper),
    and training uses two threads (the forward on the caller's, the backward on autograd's
    device thread). Measured as what one `linear` forward and backward leave allocated after
    the tensors are gone, from freshly cleared workspaces. 0 on CPU."""
    if device.type != "cuda":
        return 0
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    torch.cuda.synchronize(device)
    if clear is not None:
        clear()
    before = torch.cuda.memory_allocated(device)
    a = torch.randn(256, 256, device=device, requires_grad=True)
    w = torch.randn(256, 256, device=device, requires_grad=True)
    b = torch.randn(256, device=device, requires_grad=True)
    torch.nn.functional.linear(a, w, b).sum().backward()
    torch.cuda.synchronize(device)
    del a, w, b
    return max(0, torch.cuda.memory_allocated(device) - before)


@dataclass
class LayerMeasurement:
    name: str
    kind: str
    fwd_ms: float
    bwd_ms: float
    param_bytes: int
    buffer_bytes: int
    activation_bytes: int
    output_bytes: int
    bwd_input_ms: float | None = None  # zero bubble: the backward's two parts, measured apart
    bwd_weight_ms: float | None = None
    split_backward: bool = True  # False: B then W failed on it, or it recomputes (`measure_bw_split`)
    recomputes: bool = False  # its backward runs its forward again (the user's own checkpoint)
    split_bytes: SplitBytes | None = None  # zero bubble and recomputation: see `split_bytes`
    frozen_param_bytes: int = 0  # of param_bytes, parameters with requires_grad=False
    # one optimizer step over the layer's trainable parameters, per optimizer (`profiler.optimizers`)
    optimizer_ms: dict[str, float] | None = None


def param_bytes(module: torch.nn.Module) -> int:
    """A layer's `param_bytes`: its parameters' bytes, a shared one once. The runtime counts
    the model it builds the same way (`runtime.stages.parameter_mismatch`)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def frozen_param_bytes(module: torch.nn.Module) -> int:
    """A layer's `frozen_param_bytes`: of `param_bytes`, the parameters with requires_grad=False."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if not p.requires_grad)


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) value."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = getattr(t, "_local_tensor", None)  # a DTensor: this rank's shard is what it holds
    if isinstance(local, torch.Tensor):
        t = local
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(t), t.numel() * t.element_size()


@contextmanager
def count_saved_bytes(exclude: list[torch.Tensor] | None = None,
                      excluded_saved: set[int] | None = None) -> Iterator[dict[int, int]]:
    """Inside the block, record every tensor autograd saves for backward: storage -> bytes.
    Storages of `exclude` (parameters, buffers) are not counted; those saved are added to
    `excluded_saved` where given. (Under these hooks autograd does not check a saved tensor's
    version: one changed in place before its backward goes unnoticed.)"""
    skip = {_storage_key(t)[0] for t in exclude or []}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr in skip:
            if excluded_saved is not None:
                excluded_saved.add(ptr)
        elif ptr not in seen:
            seen[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


class Timer:
    """Milliseconds of a region. CUDA: CUDA events (synchronised). CPU: `clock="wall"` is
    `time.perf_counter` (monotonic wall clock); `clock="thread"` is `time.thread_time`, the CPU
    time of the calling thread, which other processes on a busy machine cannot inflate; it
    counts all the work only with one torch thread (`torch.set_num_threads(1)`), since CPU
    autograd runs on the calling thread."""

    def __init__(self, device: torch.device, clock: str = "wall") -> None:
        self.cuda = device.type == "cuda"
        self.now = time.thread_time if clock == "thread" else time.perf_counter

    def start(self) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return self.now()

    def stop(self, started: Any) -> float:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            return float(started.elapsed_time(ev))
        return (self.now() - started) * 1e3


INPLACE_ON_LEAF = "leaf Variable that requires grad is being used in an in-place operation"


def _fresh(stage: StageModule, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stage's inputs as new autograd leaves (model inputs stay plain data); copies of
    them where the stage modifies an input in place (`copy_inputs`, set by `_forward_fresh`):
    autograd forbids that on a leaf, while in the whole model the tensor is an intermediate."""
    feed = {}
    copy = getattr(stage, "copy_inputs", False)
    needs = getattr(values, "needs_grad", None)  # (`layer_values`: else every float value)
    for k in stage.input_keys:
        v = values[k]
        if not k.startswith(INPUT_NODE):
            grad = (v.is_floating_point() or v.is_complex()) and (needs is None or needs.get(k, True))
            v = v.detach().requires_grad_(grad)
            if copy:
                v = v.clone()
        feed[k] = v
    return feed


def _forward_fresh(stage: StageModule, values: dict[str, Any], counted: list[torch.Tensor] | None = None
                   ) -> tuple[dict[str, Any], Any, dict[int, int]]:
    """`stage(_fresh(stage, values))`, its feed and (with `counted`, the state
    `count_saved_bytes` leaves out) what it saved. A layer that modifies its input in place
    (`nn.ReLU(inplace=True)` as a layer of its own, `x.add_(...)` first thing in a block)
    fails on a leaf: the first time, it runs again on copies, and from then on always."""
    while True:
        feed = _fresh(stage, values)
        try:
            with (count_saved_bytes(counted) if counted is not None else contextlib.nullcontext({})) as seen:
                out = stage(feed)
            return feed, out, seen
        except RuntimeError as exc:
            if INPLACE_ON_LEAF not in str(exc) or getattr(stage, "copy_inputs", False):
                raise
        stage.copy_inputs = True  # type: ignore[attr-defined]


def _grad_targets(out: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def _detached(t: Any) -> Any:
    """A tensor's detached view (no copy) that requires grad where the tensor does."""
    if isinstance(t, torch.Tensor):
        return t.detach().requires_grad_(t.requires_grad)
    return t


class LayerValues(dict):  # type: ignore[type-arg]
    """`layer_values`: value key -> value, and `needs_grad`: key -> whether it needs a gradient
    in training (made from trained weights or from values that need one)."""

    needs_grad: dict[str, bool]


def layer_values(lg: LayerGraph, inputs: tuple[torch.Tensor, ...]) -> LayerValues:
    """Every value crossing a layer boundary, from running the layers one by one, each on its
    inputs as training has them (as new leaves needing a gradient where that value does, so
    `needs_grad` follows: a frozen feature extractor's output under no_grad needs none, and
    code that reads it with `.numpy()`, legal in one process, failed on a leaf made to need one);
    each layer's autograd graph is dropped after it."""
    values = LayerValues({input_key(i): t for i, t in enumerate(inputs)})
    values.needs_grad = {}
    for name in lg.layer_names():
        stage = build_stage(lg, [name])
        with torch.enable_grad():
            _, out, _ = _forward_fresh(stage, values)
        for k, v in out.items():
            values.needs_grad[k] = bool(_grad_targets(v))
            values[k] = pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, v)
    return values


class StageRunner:
    """Times one stage: each `once()` is one forward and one backward on fresh input leaves."""

    def __init__(self, stage: StageModule, values: dict[str, Any], device: torch.device,
                 clock: str = "wall") -> None:
        self.stage, self.values, self.timer = stage, values, Timer(device, clock)
        _, out, seen = _forward_fresh(stage, values, list(stage.parameters()) + list(stage.buffers()))
        self.activation_bytes = sum(seen.values())
        self.output_bytes = tensor_bytes(out)
        self.grads = [torch.ones_like(t) for t in _grad_targets(out)]
        self.fwd: list[float] = []
        self.bwd: list[float] = []

    def once(self, keep: bool) -> None:
        self.stage.zero_grad(set_to_none=False)
        feed = _fresh(self.stage, self.values)
        t0 = self.timer.start()
        out = self.stage(feed)
        f = self.timer.stop(t0)
        targets = _grad_targets(out)
        t1 = self.timer.start()
        if targets:
            torch.autograd.backward(targets, self.grads)
        b = self.timer.stop(t1) if targets else 0.0
        if keep:
            self.fwd.append(f)
            self.bwd.append(b)


class WholeRunner:
    """Times the whole model: forward, then backward from the loss's gradient with respect to
    the model's output (so both compare with per-layer sums); the loss is timed apart."""

    def __init__(self, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                 loss_fn: Callable[[Any, Any], Any], device: torch.device, clock: str = "wall") -> None:
        self.model, self.inputs, self.target, self.loss_fn = model, inputs, target, loss_fn
        self.device, self.timer = device, Timer(device, clock)
        state = list(model.parameters()) + list(model.buffers())
        with count_saved_bytes(state) as seen:
            out = model(*inputs)
        self.activation_bytes = sum(seen.values())
        with count_saved_bytes(state) as seen_by_loss:  # e.g. cross-entropy keeps its log-probs
            loss = loss_fn(out, target)
        self.loss_activation_bytes = sum(seen_by_loss.values())
        del loss
        self.loss_workspace_bytes = loss_workspace_bytes(out, target, loss_fn, device)
        del out
        self.fwd: list[float] = []
        self.bwd: list[float] = []
        self.loss: list[float] = []
        self.wall: list[float] = []  # each pass on the wall clock too, whatever `clock` is

    def once(self, keep: bool) -> None:
        self.model.zero_grad(set_to_none=False)
        w0 = time.perf_counter()
        t0 = self.timer.start()
        out = self.model(*self.inputs)
        f = self.timer.stop(t0)
        t1 = self.timer.start()
        leaves = _grad_targets(out)
        # the loss on a detached view of the output: its gradient with respect to each output
        # tensor alone, not through the model (an output may feed another, e.g. hidden
        # states returned beside the logits computed from them: a gradient taken through the
        # model would free its graph before the backward below and count that path twice)
        view = pytree.tree_map(_detached, out)
        loss = self.loss_fn(view, self.target)
        grads = torch.autograd.grad(loss, _grad_targets(view), allow_unused=True)
        lo = self.timer.stop(t1)
        pairs = [(t, g) for t, g in zip(leaves, grads, strict=True) if g is not None]
        t2 = self.timer.start()
        if pairs:
            torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        b = self.timer.stop(t2)
        wall = (time.perf_counter() - w0) * 1e3
        if keep:
            self.fwd.append(f)
            self.bwd.append(b)
            self.loss.append(lo)
            self.wall.append(wall)


def loss_workspace_bytes(out: Any, target: Any, loss_fn: Callable[[Any, Any], Any],
                         device: torch.device) -> int:
    """The loss's backward working memory: the most bytes its backward to the model's output
    allocates at once beyond what it saved (`profiler.allocations`, the loss's forward as the
    setup), which the saved-tensor hooks do not see. A cross-entropy allocates two tensors the
    size of the logits (the gradients of the log-probabilities and of the logits) while its
    saved log-probabilities are alive. Measured on a detached view of `out` (no copy): the
    model's graph, hooks on its output and a custom Function's saved state are not touched,
    and the random number generators are put back, so training is as without it. Where it
    cannot be measured, the gradients of the output alone (a lower figure). The profiler and
    the runtime's last stage (on CPU) both measure it here."""
    from profiler.allocations import peak_new_bytes

    view = pytree.tree_map(_detached, out)
    leaves = _grad_targets(view)
    if not leaves:
        return 0

    def work(loss: Any) -> Any:
        if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
            return None
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        peak, _ = peak_new_bytes(work, device, setup=lambda: loss_fn(view, target))
    return peak if peak is not None else tensor_bytes(leaves)


@dataclass
class WholeMeasurement:
    fwd_ms: float
    bwd_ms: float
    loss_ms: float  # loss forward + its backward to the model's output (in neither of the above)
    activation_bytes: int
    peak_memory_bytes: int | None
    loss_activation_bytes: int = 0  # what the loss keeps for its backward (the last stage holds it)
    loss_workspace_bytes: int = 0  # what the loss's backward allocates beyond that, at its peak
    wall_ms: float | None = None  # forward + loss + backward on the wall clock (median)


def _rounds(runners: list[Any], warmup: int, repeats: int,
            on_round: Callable[[int, int], None] | None) -> None:
    """Round-robin: every runner once per round, so a slow spell of the machine hits layers
    and whole model alike instead of skewing one of them."""
    total = warmup + repeats
    for r in range(total):
        for runner in runners:
            runner.once(keep=r >= warmup)
        if on_round:
            on_round(r + 1, total)


class _Scale(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w


def overhead_runner(device: torch.device, clock: str = "wall") -> StageRunner:
    """A stage doing almost nothing (one number times a one-number weight): its times are the fixed
    cost of calling a stage and starting its backward, which the per-layer times subtract
    (the whole model pays it once, a sum over L layers would pay it L times)."""
    from profiler.graph import trace

    x = torch.ones(1, device=device)
    lg = trace(torch.nn.Sequential(_Scale(), _Scale()).to(device), (x,))
    values = layer_values(lg, (x,))
    return StageRunner(build_stage(lg, lg.layer_names()[-1:]), values, device, clock)


@dataclass
class Overhead:
    fwd_ms: float = 0.0
    bwd_ms: float = 0.0


def _overhead(run: StageRunner | None) -> Overhead:
    if run is None:
        return Overhead()
    return Overhead(statistics.median(run.fwd), statistics.median(run.bwd))


def _layer_result(lg: LayerGraph, runners: list[StageRunner],
                  overhead: Overhead | None = None) -> list[LayerMeasurement]:
    oh = overhead or Overhead()
    out = []
    for layer, run in zip(lg.layers, runners, strict=True):
        params = param_bytes(run.stage)
        frozen = frozen_param_bytes(run.stage)
        buffers = sum(b.numel() * b.element_size() for b in run.stage.buffers())
        fwd = max(0.0, statistics.median(run.fwd) - oh.fwd_ms) if run.fwd else 0.0
        bwd = max(0.0, statistics.median(run.bwd) - oh.bwd_ms) if any(run.bwd) else 0.0
        out.append(LayerMeasurement(
            layer.name, layer.kind, fwd, bwd, params, buffers, run.activation_bytes, run.output_bytes,
            frozen_param_bytes=frozen,
        ))
        run.stage.zero_grad(set_to_none=True)
    return out


def _whole_result(run: WholeRunner) -> WholeMeasurement:
    peak = None
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
        run.once(keep=False)
        peak = int(torch.cuda.max_memory_allocated(run.device))
    run.model.zero_grad(set_to_none=True)
    return WholeMeasurement(statistics.median(run.fwd), statistics.median(run.bwd),
                            statistics.median(run.loss), run.activation_bytes, peak,
                            run.loss_activation_bytes, run.loss_workspace_bytes,
                            statistics.median(run.wall))


def measure_layers(lg: LayerGraph, inputs: tuple[torch.Tensor, ...], device: torch.device,
                   warmup: int = 2, repeats: int = 5) -> list[LayerMeasurement]:
    """Every layer: bytes from `build_stage(lg, [layer])` run on the values before it, times
    from whole passes (`profiler.inwhole`)."""
    values = layer_values(lg, inputs)
    runners = [StageRunner(build_stage(lg, [name]), values, device) for name in lg.layer_names()]
    timed = InWholeRunner(lg, inputs, device)
    _rounds([timed], warmup, repeats, None)
    return _in_whole_result(lg, runners, timed)


def measure_whole(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                  loss_fn: Callable[[Any, Any], Any], device: torch.device,
                  warmup: int = 2, repeats: int = 5) -> WholeMeasurement:
    run = WholeRunner(model, inputs, target, loss_fn, device)
    _rounds([run], warmup, repeats, None)
    return _whole_result(run)


def _in_whole_result(lg: LayerGraph, runners: list[StageRunner], timed: InWholeRunner
                     ) -> list[LayerMeasurement]:
    out = _layer_result(lg, runners)
    for i, m in enumerate(out):
        m.fwd_ms = statistics.median(run[i] for run in timed.fwd)
        m.bwd_ms = statistics.median(run[i] for run in timed.bwd)
    timed.zero()
    return out


class SplitRunner:
    """Times one layer's backward in the two parts a zero-bubble schedule runs apart, as the
    runtime runs them (`runtime.split_backward`): B, the gradient of its inputs
    (`backward_input`, the graph kept), then W, the gradient of its weights from the
    intermediates B recorded (`backward_weight`), on one forward. W does not run again the
    nodes between the weights and the outputs that B ran (`autograd.grad` from the outputs to
    the weights would: a layer whose backward is mostly on the input path got half of it
    priced as W). A layer without parameters is all B; one whose inputs need no gradient, all W."""

    def __init__(self, stage: StageModule, values: dict[str, Any], device: torch.device,
                 clock: str = "wall") -> None:
        self.stage, self.values, self.timer = stage, values, Timer(device, clock)
        self.weights = [p for p in stage.parameters() if p.requires_grad]
        self.b: list[float] = []
        self.w: list[float] = []
        self.recomputes = False  # B ran a module's forward (`PendingWeights.recomputes`)

    def once(self, keep: bool) -> None:
        from runtime.split_backward import backward_input, backward_weight

        feed, out, _ = _forward_fresh(self.stage, self.values)
        targets = _grad_targets(out)
        leaves = [v for v in feed.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        b = w = 0.0
        if targets:
            grads = [torch.ones_like(t) for t in targets]
            t0 = self.timer.start()
            _, pending = backward_input(targets, grads, leaves, self.weights)
            b = self.timer.stop(t0) if leaves else 0.0
            self.recomputes = self.recomputes or pending.recomputes
            if self.weights:
                t1 = self.timer.start()
                backward_weight(pending, self.weights)
                w = self.timer.stop(t1)
                for p in self.weights:  # the profiler's passes keep no gradients
                    p.grad = None
        if keep:
            self.b.append(b)
            self.w.append(w)


def _runs_only_whole(exc: RuntimeError) -> bool:
    """Whether a backward that ran whole failed in two parts (B, then W) because it can only
    run whole; not the errors `twice_refused` has advice for (a compiled module's donated
    buffers, a reentrant checkpoint: those refuse the runtime's other passes too), nor an
    allocation that failed (the device's)."""
    from profiler.loader import twice_refused

    oom = isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()
    return twice_refused(exc) is None and not oom


def measure_bw_split(lg: LayerGraph, inputs: tuple[torch.Tensor, ...], device: torch.device,
                     warmup: int = 1, repeats: int = 5, clock: str = "wall"
                     ) -> dict[str, tuple[float, float] | str | None]:
    """Per layer name: (B ms, W ms), medians of `repeats` after `warmup` rounds; None for a
    layer whose backward fails when run in those two parts though it ran whole (a custom
    Function whose backward writes into a tensor it saved: legal where the backward runs once,
    but W runs its node again), "recomputes" for one whose B runs its forward again (the user's
    own torch.utils.checkpoint: W recomputes once more, B + W cost 2x its backward and more).
    Such a layer is trained by one backward: 1F1B and GPipe as always, ZB-H1 with its stage's
    backward fused (`LayerProfile.split_backward`). Other errors are raised (`_runs_only_whole`)."""
    values = layer_values(lg, inputs)
    runners: dict[str, SplitRunner] = {}
    out: dict[str, tuple[float, float] | str | None] = {}
    for name in lg.layer_names():
        runner = SplitRunner(build_stage(lg, [name]), values, device, clock)
        try:
            runner.once(keep=False)
        except RuntimeError as exc:
            if not _runs_only_whole(exc):
                raise
            for p in runner.weights:
                p.grad = None
            out[name] = None
            continue
        if runner.recomputes:
            out[name] = "recomputes"
            continue
        runners[name] = runner
    _rounds(list(runners.values()), warmup, repeats, None)
    for name, r in runners.items():
        out[name] = (statistics.median(r.b), statistics.median(r.w))
    return {name: out[name] for name in lg.layer_names()}


@dataclass
class SplitBytes:
    """What a layer holds, per profiled batch, beyond its activations when its backward is
    split (B then W) or recomputed; see `split_bytes`."""

    weight_grad_bytes: int  # gradients B keeps for W
    weight_grad_output_bytes: int  # the part of those that is the layer's outputs' gradients
    saved_input_bytes: int  # of the layer's activation_bytes, its own inputs
    # of the tensors the layer hands on or reads (graph tensor ids), those it saves for its
    # backward, with their storages' bytes: where two layers save one (a tanh's output the next
    # Linear saves as its input), a stage holding both keeps it once (`profile.shared_saved`)
    saved_keys: dict[str, int] = field(default_factory=dict)
    # per key of `saved_keys`, the storage its value has in the whole model's forward (the
    # `values` given): a layer that hands its input on unchanged makes two keys of one storage
    saved_storages: dict[str, int] = field(default_factory=dict)


def split_bytes(stage: StageModule, values: dict[str, Any]) -> SplitBytes:
    """The layer as a stage by itself, through the runtime's split backward
    (runtime.split_backward): the gradients B keeps for W at the intermediates where its
    weights join the input path — its outputs' gradients among them only where one is also
    such an intermediate's (a residual layer passes its output's gradient on unchanged) —
    each storage once, none that the forward saved or that is a parameter; and how much of
    what its forward saves is its own inputs (a recomputed block keeps those anyway)."""
    from runtime.split_backward import backward_input

    weights = [p for p in stage.parameters() if p.requires_grad]
    skip = {_storage_key(t)[0] for t in [*stage.parameters(), *stage.buffers()]}
    feed, out, saved = _forward_fresh(stage, values, list(stage.parameters()) + list(stage.buffers()))
    inputs = {_storage_key(v)[0] for v in feed.values() if isinstance(v, torch.Tensor)}
    saved_inputs = sum(n for ptr, n in saved.items() if ptr in inputs)
    keys = {k: saved[ptr] for k, v in [*feed.items(), *(out.items() if isinstance(out, dict) else ())]
            if isinstance(v, torch.Tensor) and (ptr := _storage_key(v)[0]) in saved}
    storages = {k: _storage_key(values[k])[0] for k in keys if isinstance(values.get(k), torch.Tensor)}
    targets = _grad_targets(out)
    leaves = [v for v in feed.values() if isinstance(v, torch.Tensor) and v.requires_grad]
    if not targets or not weights:
        return SplitBytes(0, 0, saved_inputs, keys, storages)
    grads = [torch.ones_like(t) for t in targets]
    try:
        _, pending = backward_input(targets, grads, leaves, weights)
    except RuntimeError as exc:  # (a backward that runs only whole: `measure_bw_split`)
        if not _runs_only_whole(exc):
            raise
        return SplitBytes(0, 0, saved_inputs, keys, storages)
    outputs = {_storage_key(g)[0] for g in grads}
    held: dict[int, int] = {}
    for group in pending.groups:
        for gs in group["grads"]:
            for g in gs or ():
                if isinstance(g, torch.Tensor):
                    ptr, nbytes = _storage_key(g)
                    if ptr not in saved and ptr not in skip:
                        held.setdefault(ptr, nbytes)
    return SplitBytes(sum(held.values()), sum(n for ptr, n in held.items() if ptr in outputs),
                      saved_inputs, keys, storages)


def _graph_nodes(outputs: list[torch.Tensor]) -> list[Any]:
    """Every autograd node the backward of `outputs` runs, each once."""
    seen: set[int] = set()
    nodes: list[Any] = []
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        nodes.append(node)
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return nodes


@dataclass
class LayerInspection:
    """What one forward of each layer shows beyond its trace (`inspect_layers`)."""

    # (layer, parameter name): a trained parameter of the model the layer uses without holding it
    foreign: list[tuple[str, str]] = field(default_factory=list)
    # (layer, Function, attribute names, bytes): tensors a custom Function keeps as plain ctx
    # attributes, which saved-tensor hooks (`count_saved_bytes`) do not see
    ctx_held: list[tuple[str, str, list[str], int]] = field(default_factory=list)


def inspect_layers(lg: LayerGraph, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]
                   ) -> LayerInspection:
    """One forward of each layer as a stage of its own, and its autograd graph walked:
    - a trained parameter of the model that the graph reaches (an AccumulateGrad) but the
      stage does not hold: read through an attribute that is not a registered submodule or
      parameter (a plain list, a closure), so no trace sees it, and a stage would train its
      own copy apart from the layer that owns it (gradients silently wrong);
    - tensors a custom autograd.Function keeps as `ctx.<name> = tensor` rather than with
      `ctx.save_for_backward`: memory the profile's activation bytes leave out (the model's
      parameters and buffers aside, each storage once)."""
    names = {id(p): k for k, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
    state = {id(t) for t in [*model.parameters(), *model.buffers()]}
    values = layer_values(lg, inputs)
    out = LayerInspection()
    for name in lg.layer_names():
        stage = build_stage(lg, [name])
        own = {id(p) for p in stage.parameters()}
        with torch.enable_grad():
            _, result, _ = _forward_fresh(stage, values)
        for node in _graph_nodes(_grad_targets(result)):
            variable = getattr(node, "variable", None)  # an AccumulateGrad: a leaf's gradient sink
            if isinstance(variable, torch.Tensor):
                if id(variable) in names and id(variable) not in own:
                    out.foreign.append((name, names[id(variable)]))
                continue
            if not isinstance(node, torch.autograd.function.BackwardCFunction):
                continue
            storages: dict[int, int] = {}
            attrs = []
            for attr, value in vars(node).items():
                held = [t for t in pytree.tree_leaves(value)
                        if isinstance(t, torch.Tensor) and id(t) not in state]
                for t in held:
                    ptr, nbytes = _storage_key(t)
                    storages.setdefault(ptr, nbytes)
                if held:
                    attrs.append(attr)
            if storages:
                out.ctx_held.append((name, type(node).__name__.removesuffix("Backward"), attrs,
                                     sum(storages.values())))
    return out


def measure_split_bytes(lg: LayerGraph, inputs: tuple[torch.Tensor, ...]) -> dict[str, SplitBytes]:
    """Per layer name: `split_bytes` (one pass each, untimed)."""
    values = layer_values(lg, inputs)
    return {name: split_bytes(build_stage(lg, [name]), values) for name in lg.layer_names()}


def measure_all(lg: LayerGraph, model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                target: Any, loss_fn: Callable[[Any, Any], Any], device: torch.device,
                warmup: int = 2, repeats: int = 5,
                on_round: Callable[[int, int], None] | None = None, clock: str = "wall",
                subtract_overhead: bool = True, layer_timing: str = "in-whole",
                ) -> tuple[list[LayerMeasurement], WholeMeasurement, Overhead]:
    """Layers and whole model measured in interleaved rounds (see `_rounds`). Layer times come
    from whole passes (`in-whole`) or from each layer alone (`isolated`, minus the fixed
    per-stage call cost with `subtract_overhead`); the stage overhead is returned."""
    if layer_timing not in ("in-whole", "isolated"):
        raise PipeplanError(f"layer timing {layer_timing!r}: use 'in-whole' or 'isolated'")
    values = layer_values(lg, inputs)
    runners = [StageRunner(build_stage(lg, [name]), values, device, clock) for name in lg.layer_names()]
    whole = WholeRunner(model, inputs, target, loss_fn, device, clock)
    null = overhead_runner(device, clock)
    if layer_timing == "in-whole":
        timed = InWholeRunner(lg, inputs, device, clock)
        _rounds([timed, whole, null], warmup, repeats, on_round)
        layers, oh = _in_whole_result(lg, runners, timed), _overhead(null)
    else:
        _rounds([*runners, whole, null], warmup, repeats, on_round)
        oh = _overhead(null)
        layers = _layer_result(lg, runners, oh if subtract_overhead else None)
    split = measure_bw_split(lg, inputs, device, min(warmup, 1), repeats, clock)
    held = measure_split_bytes(lg, inputs)
    for m in layers:
        parts = split[m.name]
        if parts is None or isinstance(parts, str):  # one backward: on the input's path, nothing deferred
            m.bwd_input_ms, m.bwd_weight_ms, m.split_backward = m.bwd_ms, 0.0, False
            m.recomputes = parts == "recomputes"
        else:
            m.bwd_input_ms, m.bwd_weight_ms = parts
        m.split_bytes = held[m.name]
    from profiler.optimizers import step_ms_all  # (it times with this module's Timer)

    for m, run in zip(layers, runners, strict=True):
        m.optimizer_ms = step_ms_all(run.stage.parameters(), device, min(warmup, 1), repeats, clock,
                                     label=m.name)
    return layers, _whole_result(whole), oh
