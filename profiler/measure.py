"""Measure layers and whole models on one device: times, parameter and activation bytes.

- times: median over `repeats` runs after `warmup` runs; on CPU with `time.perf_counter`, on
  CUDA with CUDA events (synchronised). Gradients are reset before every run.
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

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from profiler.graph import LayerGraph, StageModule, build_stage


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


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in a (nested) value."""
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    try:
        s = t.untyped_storage()
        return s.data_ptr(), s.nbytes()
    except (RuntimeError, NotImplementedError):  # tensor subclasses without a plain storage
        return id(t), t.numel() * t.element_size()


@contextmanager
def count_saved_bytes(exclude: list[torch.Tensor] | None = None) -> Iterator[dict[int, int]]:
    """Inside the block, record every tensor autograd saves for backward: storage -> bytes.
    Storages of `exclude` (parameters, buffers) are not counted."""
    skip = {_storage_key(t)[0] for t in exclude or []}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in skip and ptr not in seen:
            seen[ptr] = nbytes
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield seen


class Timer:
    """Wall-clock milliseconds of a region: perf_counter on CPU, CUDA events on CUDA."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def start(self) -> Any:
        if self.cuda:
            torch.cuda.synchronize()
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, started: Any) -> float:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            torch.cuda.synchronize()
            return float(started.elapsed_time(ev))
        return (time.perf_counter() - started) * 1e3


def _fresh(stage: StageModule, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stage's inputs as new autograd leaves (model inputs stay plain data)."""
    feed = {}
    for k in stage.input_keys:
        v = values[k]
        if not k.startswith("<input>"):
            v = v.detach().requires_grad_(v.is_floating_point() or v.is_complex())
        feed[k] = v
    return feed


def _grad_targets(out: dict[str, Any]) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]


def layer_values(lg: LayerGraph, inputs: tuple[torch.Tensor, ...]) -> dict[str, Any]:
    """Every value crossing a layer boundary, from running the layers one by one (no grad)."""
    values: dict[str, Any] = {f"<input>:{i}": t for i, t in enumerate(inputs)}
    with torch.no_grad():
        for name in lg.layer_names():
            stage = build_stage(lg, [name])
            values.update(stage({k: values[k] for k in stage.input_keys}))
    return values


def measure_stage(stage: StageModule, values: dict[str, Any], device: torch.device,
                  warmup: int, repeats: int) -> tuple[float, float, int, int]:
    """(fwd_ms, bwd_ms, activation_bytes, output_bytes) of one stage fed from `values`."""
    timer = Timer(device)
    state = list(stage.parameters()) + list(stage.buffers())
    with count_saved_bytes(state) as seen:
        out = stage(_fresh(stage, values))
    activation = sum(seen.values())
    output = tensor_bytes(out)
    targets = _grad_targets(out)
    grads = [torch.ones_like(t) for t in targets]
    del out, targets
    fwd, bwd = [], []
    for i in range(warmup + repeats):
        stage.zero_grad(set_to_none=True)
        feed = _fresh(stage, values)
        t0 = timer.start()
        out = stage(feed)
        f = timer.stop(t0)
        targets = _grad_targets(out)
        t1 = timer.start()
        if targets:
            torch.autograd.backward(targets, grads)
        b = timer.stop(t1)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b if targets else 0.0)
        del out, targets, feed
    stage.zero_grad(set_to_none=True)
    return statistics.median(fwd), statistics.median(bwd), activation, output


def measure_layers(lg: LayerGraph, inputs: tuple[torch.Tensor, ...], device: torch.device,
                   warmup: int = 2, repeats: int = 5,
                   on_layer: Callable[[str], None] | None = None) -> list[LayerMeasurement]:
    values = layer_values(lg, inputs)
    out = []
    for layer in lg.layers:
        stage = build_stage(lg, [layer.name])
        fwd, bwd, act, outb = measure_stage(stage, values, device, warmup, repeats)
        params = sum(p.numel() * p.element_size() for p in stage.parameters())
        buffers = sum(b.numel() * b.element_size() for b in stage.buffers())
        out.append(LayerMeasurement(layer.name, layer.kind, fwd, bwd, params, buffers, act, outb))
        if on_layer:
            on_layer(layer.name)
    return out


@dataclass
class WholeMeasurement:
    fwd_ms: float
    bwd_ms: float
    activation_bytes: int
    peak_memory_bytes: int | None


def measure_whole(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: Any,
                  loss_fn: Callable[[Any, Any], Any], device: torch.device,
                  warmup: int = 2, repeats: int = 5) -> WholeMeasurement:
    """Forward (model only) and backward (from the loss) of the whole model at once."""
    timer = Timer(device)
    state = list(model.parameters()) + list(model.buffers())
    with count_saved_bytes(state) as seen:
        model(*inputs)
    activation = sum(seen.values())
    fwd, bwd = [], []
    peak = None
    for i in range(warmup + repeats):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda" and i == warmup + repeats - 1:
            torch.cuda.reset_peak_memory_stats(device)
        t0 = timer.start()
        out = model(*inputs)
        f = timer.stop(t0)
        loss = loss_fn(out, target)
        t1 = timer.start()
        loss.backward()
        b = timer.stop(t1)
        if i >= warmup:
            fwd.append(f)
            bwd.append(b)
        del out, loss
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
    model.zero_grad(set_to_none=True)
    return WholeMeasurement(statistics.median(fwd), statistics.median(bwd), activation, peak)
