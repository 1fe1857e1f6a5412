"""Profile a model file end to end: load, trace, measure every layer and the whole model,
and return a `planner.formats.Profile` (what `python -m planner profile` writes)."""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from pydantic import ValidationError

from planner.errors import PipeplanError, first_line
from planner.formats import DeviceInfo, LayerProfile, Measured, ModelRef, Profile
from profiler.graph import LayerGraph, trace
from profiler.host_memory import keep_large_blocks
from profiler.loader import (
    batch_checked,
    build_checked,
    call_user,
    eval_mode_note,
    load_model_file,
    loss_checked,
    twice_refused,
    user_line,
)
from profiler.measure import inspect_layers, library_workspace_bytes, measure_all

CTX_HELD_WARN_BYTES = 64 * 1024  # a scalar or a small table on ctx is not worth a warning


class ProfileWarning(UserWarning):
    """Something the profile leaves out that the user can change in the model."""


MAX_BATCH_SIZE = 2**31 - 1  # rows of one profiled batch: beyond it, a typo


def resolve_device(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise PipeplanError(
                f"--device {name}: no CUDA device is available (torch {torch.__version__}, "
                f"CUDA build: {torch.version.cuda or 'no'}). Profile with --device cpu, or run "
                "on a machine with a GPU and a CUDA build of torch."
            )
        return torch.device(name)
    raise PipeplanError(f"--device {name!r}: use 'cpu' or 'cuda'")


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def _to(value: Any, device: torch.device) -> Any:
    return torch.utils._pytree.tree_map(
        lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value
    )


def _dtype(model: torch.nn.Module) -> str:
    for p in model.parameters():
        if p.is_floating_point():
            return str(p.dtype).removeprefix("torch.")
    return "float32"


MAX_ROUNDS = 10_000  # of warm-up or timed runs per layer


def max_threads() -> int:
    """The most torch threads a process may ask for: 64, or four per core where that is more (at 10,000, torch hung or
    crashed)."""
    return max(64, 4 * (os.cpu_count() or 1))


def check_threads(threads: int) -> None:
    if not 1 <= threads <= max_threads():
        raise PipeplanError(f"--threads {threads}: give 1..{max_threads()} (this machine has "
                            f"{os.cpu_count()} cores)")


def profile_model_file(
    path: str | Path,
    batch_size: int,
    device: str = "cpu",
    warmup: int = 2,
    repeats: int = 5,
    granularity: str = "blocks",
    on_round: Callable[[int, int], None] | None = None,
    on_traced: Callable[[LayerGraph], None] | None = None,
    seed: int = 0,
    threads: int | None = None,
    clock: str = "wall",
    subtract_overhead: bool = True,
    layer_timing: str = "in-whole",
) -> Profile:
    """Profile `path` at `batch_size`. Progress: `on_traced(layer_graph)` once, then
    `on_round(done, total)` after each measuring round (every layer and the whole model once)."""
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise PipeplanError(f"--batch-size {batch_size}: give the rows of one profiled batch, from 1 "
                            f"to {MAX_BATCH_SIZE} (a microbatch's size: the planner scales it)")
    if warmup < 0 or repeats < 1 or warmup > MAX_ROUNDS or repeats > MAX_ROUNDS:
        raise PipeplanError(f"--warmup {warmup} --repeats {repeats}: give --warmup 0..{MAX_ROUNDS} and "
                            f"--repeats 1..{MAX_ROUNDS} (each round runs every layer once)")
    started = time.perf_counter()
    dev = resolve_device(device)
    keep_large_blocks()  # as every runtime rank does: the profile prices what the run pays
    if threads is not None:
        check_threads(threads)
        torch.set_num_threads(threads)
    if clock not in ("wall", "thread"):
        raise PipeplanError(f"--clock {clock!r}: use 'wall' or 'thread'")
    if clock == "thread" and (dev.type != "cpu" or torch.get_num_threads() != 1):
        raise PipeplanError(
            "--clock thread measures the calling thread's CPU time: it needs --device cpu and "
            "--threads 1 (with more threads the work in the other threads would not be counted)"
        )
    mf = load_model_file(path)
    workspace = library_workspace_bytes(dev)  # before the model's own work allocates any
    torch.manual_seed(seed)
    # the modes build_model left (`loader.eval_mode_note`): the runtime trains in them
    model = build_checked(mf, batch_size).to(dev)
    if (note := eval_mode_note(mf, model)) is not None:
        print(f"warning: {note}", file=sys.stderr)
    inputs, target = batch_checked(mf, batch_size)
    inputs, target = _to(inputs, dev), _to(target, dev)
    try:
        with torch.no_grad():
            out = model(*inputs)
    except Exception as exc:  # noqa: BLE001
        raise PipeplanError(
            f"{mf.path}: build_model()(*make_batch({batch_size})[0]) raised "
            f"{type(exc).__name__}: {exc}{user_line(exc, Path(mf.path).resolve())}. Fix the model's "
            "forward there, or, if the inputs are wrong, make_batch's inputs must be the model's "
            "positional arguments."
        ) from exc
    loss_checked(mf, out, target)
    del out
    try:  # one training step as written, so that its own errors read as the user's
        out = model(*inputs)
        loss = loss_checked(mf, out, target)
        if not loss.requires_grad:
            raise PipeplanError(
                f"{mf.path}: the loss does not depend on any parameter that requires a gradient "
                "(the model has none, all of them are frozen, or its output is detached), so "
                "there is nothing to train: give the model trainable weights")
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(out)):
            raise PipeplanError(
                f"{mf.path}: the model's forward returns a {type(out).__name__!r} object whose tensors "
                "torch's pytree utilities cannot see (a dataclass or a class of its own), so the "
                "output cannot be handed between stages or differentiated: return a tensor, or a "
                "tuple, list, dict or namedtuple of tensors (or register the class with "
                "torch.utils._pytree.register_dataclass)")
        del out
        loss.backward()
    except PipeplanError:
        raise
    except Exception as exc:  # noqa: BLE001
        first = first_line(str(exc))
        raise PipeplanError(
            f"{mf.path}: one training step, loss_fn(build_model()(*inputs), target).backward(), "
            f"raised {type(exc).__name__}: {first}. Fix the model so that this runs by hand "
            "(e.g. no in-place change of a tensor autograd saved for the backward)") from exc
    model.zero_grad(set_to_none=True)
    lg = trace(model, inputs, granularity=granularity)
    inspected = inspect_layers(lg, model, inputs)
    if foreign := inspected.foreign:
        layer, param = foreign[0]
        raise PipeplanError(
            f"{mf.path}: layer {layer} uses the parameter {param} without holding it (it reaches it "
            "through an attribute that is not a registered submodule or parameter, e.g. a plain "
            f"list), so a stage of {layer} would train a copy of its own and the gradients would be "
            f"wrong: register it in {layer} (an nn.ModuleList or attribute of the module itself), "
            "or profile at a granularity that puts both in one layer"
            + (f" ({len(foreign)} such uses)" if len(foreign) > 1 else ""))
    held = [x for x in inspected.ctx_held if x[3] >= CTX_HELD_WARN_BYTES]
    if held:
        layer, fn, attrs, nbytes = max(held, key=lambda x: x[3])
        warnings.warn(
            f"layer {layer}: the custom autograd.Function {fn} keeps {nbytes / 1e6:.3g} MB as ctx "
            f"attributes ({', '.join('ctx.' + a for a in attrs)}), which the profile's activation bytes "
            "do not count (they see what ctx.save_for_backward keeps): plans under-predict memory by "
            "that much per microbatch in flight. Keep tensors for backward with ctx.save_for_backward"
            + (f" ({len(held)} such Functions)" if len(held) > 1 else ""), ProfileWarning, stacklevel=2)
    if on_traced:
        on_traced(lg)
    try:
        layers, whole, overhead = measure_all(
            lg, model, inputs, target, lambda o, t: call_user(mf.path, "loss_fn", mf.loss_fn, o, t),
            dev, warmup, repeats, on_round=on_round, clock=clock, subtract_overhead=subtract_overhead,
            layer_timing=layer_timing,
        )
    except (PipeplanError, KeyboardInterrupt, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001  # the model, run once more, failed this time
        first = first_line(str(exc))
        if (advice := twice_refused(exc)) is not None:
            raise PipeplanError(f"{mf.path}: {advice}") from None
        raise PipeplanError(
            f"{mf.path}: the model ran once, then raised {type(exc).__name__}: {first} while it "
            "was timed (forward and backward passes, whole and layer by layer). Profiling runs "
            "the model many times: it must run the same way each time") from exc
    if recomputing := [m.name for m in layers if m.recomputes]:
        warnings.warn(
            f"layer {recomputing[0]}: its backward runs its forward again (torch.utils.checkpoint "
            "in your code): split into the inputs' gradient (B) and the weights' (W), it would "
            "recompute in each. Under ZB-H1 the stage holding it runs its backward whole (no W "
            "deferred), as plans price it; 1F1B and GPipe are unaffected"
            + (f" ({len(recomputing)} such layers)" if len(recomputing) > 1 else ""),
            ProfileWarning, stacklevel=2)
    if whole_only := [m.name for m in layers if not m.split_backward and not m.recomputes]:
        warnings.warn(
            f"layer {whole_only[0]}: its backward fails when run in two parts, the inputs' gradient "
            "(B) and then the weights' (W), though it runs whole (a custom autograd.Function whose "
            "backward writes into a tensor it saved is one cause: W runs its node again). Training "
            "is unaffected under 1F1B and GPipe; under ZB-H1 the stage holding it runs its backward "
            "whole (no W deferred), as plans price it"
            + (f" ({len(whole_only)} such layers)" if len(whole_only) > 1 else ""),
            ProfileWarning, stacklevel=2)
    layer_sum = sum(m.fwd_ms + m.bwd_ms for m in layers)
    whole_ms = whole.fwd_ms + whole.bwd_ms
    try:
        return Profile(
            model=ModelRef(path=mf.path, sha256=mf.sha256),
            device=DeviceInfo(type=dev.type, name=device_name(dev), workspace_bytes=workspace),
            batch_size=batch_size,
            dtype=_dtype(model),
            layers=[
                LayerProfile(
                    name=m.name, kind=m.kind, fwd_ms=m.fwd_ms, bwd_ms=m.bwd_ms,
                    param_bytes=m.param_bytes, activation_bytes=m.activation_bytes,
                    output_bytes=m.output_bytes, buffer_bytes=m.buffer_bytes,
                    bwd_input_ms=m.bwd_input_ms, bwd_weight_ms=m.bwd_weight_ms,
                    split_backward=None if m.split_backward else False,  # (absent: it splits)
                    frozen_param_bytes=m.frozen_param_bytes or None, optimizer_ms=m.optimizer_ms,
                    **({k: v for k, v in dataclasses.asdict(m.split_bytes).items()
                        if k not in ("saved_keys", "saved_storages")}
                       if m.split_bytes is not None else {}),
                )
                for m in layers
            ],
            edges=lg.edges(),
            measured=Measured(
                fwd_ms=whole.fwd_ms, bwd_ms=whole.bwd_ms, peak_memory_bytes=whole.peak_memory_bytes,
                activation_bytes=whole.activation_bytes, loss_ms=whole.loss_ms,
                loss_activation_bytes=whole.loss_activation_bytes,
                loss_workspace_bytes=whole.loss_workspace_bytes,
                wall_ms=whole.wall_ms if clock == "thread" and dev.type == "cpu" else None,
                layer_sum_ratio=(layer_sum / whole_ms) if whole_ms > 0 else None,
                stage_overhead_fwd_ms=overhead.fwd_ms, stage_overhead_bwd_ms=overhead.bwd_ms,
            ),
            granularity=granularity,
            trace_method=lg.method,
            shared_parameters=[{"keys": s.keys, "layers": s.layers, "bytes": s.bytes, "frozen": s.frozen,
                                "buffer": s.buffer} for s in lg.shared_parameters],
            shared_saved=shared_saved(layers),
            warmup=warmup,
            repeats=repeats,
            seed=seed,
            layer_timing=layer_timing,
            threads=torch.get_num_threads(),
            clock=clock if dev.type == "cpu" else "cuda-events",
            torch_version=torch.__version__,
            profiler_wall_s=round(time.perf_counter() - started, 3),
        )
    except ValidationError as exc:  # the passes' figures contradict each other
        first = str(exc.errors()[0]["msg"]).removeprefix("Value error, ").split(";")[0]
        raise PipeplanError(
            f"{mf.path}: the passes that measured the model disagree ({first}): most often its "
            "forward computes differently from one run to the next (a branch taken on random "
            "numbers, e.g. stochastic depth with Python's random, or on a counter); profile it "
            "with that switched off (a fixed branch)") from None


def shared_saved(layers: list[Any]) -> list[dict[str, Any]]:
    """The tensors that several layers save for their backward (the producer as its output,
    readers as their input, also through a layer that hands it on unchanged or a view of its
    storage): each with the layers and the least bytes any of them counted. Keyed by the
    storage the value has in the whole model's forward (what memory holds once)."""
    by_storage: dict[object, dict[str, Any]] = {}
    for m in layers:
        sb = m.split_bytes
        if sb is None:
            continue
        for key, nbytes in sb.saved_keys.items():
            where = sb.saved_storages.get(key, ("key", key))
            entry = by_storage.setdefault(where, {"tensor": key, "layers": {}})
            entry["layers"][m.name] = min(nbytes, entry["layers"].get(m.name, nbytes))
    return [{"tensor": e["tensor"], "layers": list(e["layers"]), "bytes": min(e["layers"].values())}
            for e in by_storage.values() if len(e["layers"]) > 1]


def check_tp_plan(path: str | Path, batch_size: int, seed: int = 0) -> None:
    """Before any measuring (`profile --tp`): the model file has a tensor-parallel plan, else
    a PipeplanError saying how to give one."""
    mf = load_model_file(path)
    torch.manual_seed(seed)
    _require_tp_plan(mf, build_checked(mf, batch_size))


def _require_tp_plan(mf: Any, model: torch.nn.Module) -> None:
    from runtime.tensor_parallel import model_tp_plan

    if not model_tp_plan(model, mf.tp_plan):
        raise PipeplanError(f"--tp: {mf.path} has no tensor-parallel plan; define "
                            "tp_plan(model) -> {module-name pattern: 'colwise' | 'rowwise' | ...} "
                            "in the model file (see examples/gpt.py)")


def add_tp_degrees(profile: Profile, path: str | Path, degrees: list[int], batch_size: int,
                   seed: int = 0, warmup: int = 2, repeats: int = 5, clock: str = "wall") -> Profile:
    """`profile` with every layer also measured on one of t tensor-parallel devices, for each t
    of `degrees` (`LayerProfile.tp`; see profiler.tensor_parallel). CPU only (a fake group)."""
    from profiler.tensor_parallel import measure_degree
    from runtime.tensor_parallel import model_tp_plan

    mf = load_model_file(path)
    torch.manual_seed(seed)
    inputs, _ = batch_checked(mf, batch_size)

    def build() -> torch.nn.Module:
        torch.manual_seed(seed)
        return build_checked(mf, batch_size)

    _require_tp_plan(mf, build())  # on its own module and model, not the file loaded again
    granularity = getattr(profile, "granularity", None) or "blocks"
    per_layer: list[list[Any]] = [list(layer.tp or []) for layer in profile.layers]
    for t in degrees:
        measured = measure_degree(build, inputs, granularity,
                                  lambda m: model_tp_plan(m, mf.tp_plan), t, warmup, repeats, clock)
        if len(measured) != len(profile.layers):
            raise PipeplanError(f"--tp {t}: the model traced into {len(measured)} layers, the "
                                f"profile has {len(profile.layers)}")
        for i, x in enumerate(measured):
            per_layer[i] = [y for y in per_layer[i] if y.degree != t] + [x]
    layers = [layer.model_copy(update={"tp": sorted(xs, key=lambda x: x.degree)})
              for layer, xs in zip(profile.layers, per_layer, strict=True)]
    return profile.model_copy(update={"layers": layers})
