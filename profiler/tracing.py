"""Capture a model's computation as a torch.fx graph whose nodes know their module path.

Internal to `profiler.graph`. `leaves` (the blocks and the modules around them, see
`segment.leaf_modules`) are never traced into: each stays one `call_module` node that calls the
user's own module object, so its Python code, custom `autograd.Function`s, hooks and in-place
buffer updates run exactly as written. Strategy, in order:
1. `torch.fx` symbolic tracing (batch-size independent) with those leaves;
2. if tracing fails inside a submodule — untraceable code, a custom `autograd.Function` (a trace
   would keep its forward and drop its backward) — or a submodule has hooks (a trace would skip
   them), that submodule becomes a leaf too, with a warning naming it, and tracing is retried;
3. if it fails at the top level (e.g. Hugging Face models: `**kwargs`, decorators),
   `torch.export` (non-strict) with the leaves' call signatures preserved, after which the
   leaves are swapped back for the user's modules (`torch.export._swap`); export specialises on
   shapes. If that fails too, a plain export (leaves traced into, with a warning).
An exported graph is then run beside the model on the example inputs, forward and backward
(`_check_export`): export records what the top-level forward computes, not what it does
besides (a hook registered on a tensor, a non-tensor argument passed to a block), and a graph
whose outputs or gradients differ from the model's, or that fails where the model runs, is
refused with an error saying so, never profiled and trained as if it were the model.
Each node's module path is its target for a `call_module`, else the innermost entry of
`node.meta["nn_module_stack"]` ("" for code in the root's own forward).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from planner.errors import PipeplanError, first_line

MAX_AUTO_LEAVES = 32

_DROP_TARGETS = {"_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range_for_size"}


@dataclass
class Traced:
    gm: fx.GraphModule
    method: str  # "fx" or "export"
    paths: dict[str, str]  # node name -> innermost module path ("" = root forward)
    out_spec: Any = None  # export only: pytree spec of the model output
    leaves: list[str] = field(default_factory=list)  # modules made leaves to make tracing work


class TracingWarning(UserWarning):
    """A module is measured and run as one piece because its inside cannot be traced faithfully."""


class _Opaque(Exception):
    """Raised inside tracing when code must run as written (a custom autograd.Function, a
    grad-mode or autocast context)."""


_CONTEXT = ("a grad-mode or autocast context (torch.no_grad, torch.enable_grad, "
            "torch.set_grad_enabled, torch.inference_mode, torch.autocast)")


class _Tracer(fx.Tracer):
    def __init__(self, extra_leaves: set[str]) -> None:
        super().__init__()
        self.extra_leaves = extra_leaves

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.extra_leaves or super().is_leaf_module(m, qualname)


def _has_hooks(m: torch.nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None))


def _split_hooked(model: torch.nn.Module, given: set[str]) -> list[str]:
    """The modules with hooks that hold modules split between stages (the model itself, or a
    module above a given leaf): no stage calls them, so their hooks do not run in a pipeline."""
    return [path for path, m in model.named_modules()
            if _has_hooks(m) and not any(path == p or path.startswith(p + ".") for p in given)
            and (not path or any(p.startswith(path + ".") for p in given))]


@contextlib.contextmanager
def _functions_are_opaque() -> Any:
    """While tracing, a custom `autograd.Function` applied to traced values stops the trace
    (symbolic tracing would record its forward's ops and lose its backward), and so does code
    that changes grad mode or enters autocast (symbolic tracing records the ops inside and
    drops the context: a stage would run them with gradients, in full precision)."""
    original = torch.autograd.Function.__dict__["apply"]
    set_grad, autocast_enter = torch._C._set_grad_enabled, torch.amp.autocast_mode.autocast.__enter__
    inference_enter = torch.autograd.grad_mode.inference_mode.__enter__

    def apply(cls: Any, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(a, fx.Proxy) for a in (*args, *kwargs.values())):
            raise _Opaque(f"custom autograd.Function {cls.__name__}")
        return original.__func__(cls, *args, **kwargs)

    def set_grad_enabled(mode: bool) -> None:
        if bool(mode) != torch.is_grad_enabled():
            raise _Opaque(_CONTEXT)
        set_grad(mode)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise _Opaque(_CONTEXT)

    torch.autograd.Function.apply = classmethod(apply)  # type: ignore[assignment]
    torch._C._set_grad_enabled = set_grad_enabled  # type: ignore[assignment]
    torch.amp.autocast_mode.autocast.__enter__ = refuse  # type: ignore[method-assign]
    torch.autograd.grad_mode.inference_mode.__enter__ = refuse  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.autograd.Function.apply = original  # type: ignore[assignment]
        torch._C._set_grad_enabled = set_grad  # type: ignore[assignment]
        torch.amp.autocast_mode.autocast.__enter__ = autocast_enter  # type: ignore[method-assign]
        torch.autograd.grad_mode.inference_mode.__enter__ = inference_enter  # type: ignore[method-assign]


_PY_RNG, _NP_RNG = "Python's random", "numpy's global random generator"
_TORCH_RNG, _CUDA_RNG = "torch's default generator", "torch's default CUDA generators"


def python_rng_states() -> dict[str, Any]:
    """Python's `random` and, where numpy imports, numpy's global generator: plain Python
    values, safe to read while torch.export traces (torch's state would be traced)."""
    states: dict[str, Any] = {_PY_RNG: random.getstate()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy comes with torch here
        return states
    states[_NP_RNG] = np.random.get_state()
    return states


def global_rng_states() -> dict[str, Any]:
    """`python_rng_states` and torch's default generators (CPU; CUDA where started)."""
    states = python_rng_states()
    states[_TORCH_RNG] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states[_CUDA_RNG] = tuple(torch.cuda.get_rng_state_all())
    return states


def set_python_rng_states(states: dict[str, Any]) -> None:
    """Python's and numpy's global generators as `python_rng_states` found them."""
    random.setstate(states[_PY_RNG])
    if _NP_RNG in states:
        import numpy as np

        np.random.set_state(states[_NP_RNG])


def set_global_rng_states(states: dict[str, Any]) -> None:
    set_python_rng_states(states)
    torch.set_rng_state(states[_TORCH_RNG])
    if _CUDA_RNG in states:
        torch.cuda.set_rng_state_all(list(states[_CUDA_RNG]))


def _same_state(a: Any, b: Any) -> bool:
    if isinstance(a, tuple | list) and isinstance(b, tuple | list):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy's key array
        return a.shape == b.shape and bool((a == b).all())
    return bool(a == b)


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [k for k, v in after.items() if k in before and not _same_state(v, before[k])]


@contextlib.contextmanager
def _glue_draws(leaves: list[torch.nn.Module]) -> Any:
    """While tracing: the global generators the traced code drew from outside `leaves` (the
    modules a trace calls as written: torch.export runs them, fx does not). Yields a list
    filled on exit; every generator is put back as it was, either way. (torch's: a draw that
    fx ran instead of recording, `torch.rand(())`; torch.export records torch's draws.)"""
    start = global_rng_states()
    ids = {id(m) for m in leaves}
    drew: list[str] = []
    mark = [python_rng_states()]  # Python's and numpy's when the glue last had control
    depth = [0]

    def note(names: list[str]) -> None:
        drew.extend(k for k in names if k not in drew)

    def pre(m: torch.nn.Module, args: Any) -> None:
        if id(m) in ids:
            if depth[0] == 0:
                note(_changed(mark[0], python_rng_states()))
            depth[0] += 1

    def post(m: torch.nn.Module, args: Any, out: Any) -> None:
        if id(m) in ids:
            depth[0] -= 1
            if depth[0] == 0:
                mark[0] = python_rng_states()  # a leaf's own draws run as written

    hooks = []
    if ids:
        hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
                 torch.nn.modules.module.register_module_forward_hook(post)]
    try:
        yield drew
        end = global_rng_states()
        note(_changed(mark[0], end) + _changed({k: v for k, v in start.items() if k not in mark[0]}, end))
    finally:
        for h in hooks:
            h.remove()
        set_global_rng_states(start)


def _refuse_glue_draws(model: torch.nn.Module, drew: list[str], where: str = "outside its blocks") -> None:
    """A draw from a global generator in the traced forward ran once, while tracing: the
    graph holds its outcome as a constant, so every step would take the same branch."""
    if not drew:
        return
    raise PipeplanError(
        f"{type(model).__name__}.forward draws from (or seeds) {' and '.join(drew)} {where} "
        "(e.g. LayerDrop: `if self.training and np.random.random() < p: continue`). Tracing "
        "runs that code once, so the draw would become a constant of the graph and pipeline "
        "training would take the same branch on every step. Draw inside a module the forward "
        "calls (a block, or a small nn.Module of its own, which runs as written on every "
        "step), or draw with torch in an operation on a traced tensor, which the trace keeps "
        "as an op (e.g. `h = torch.where(torch.rand((), device=h.device) < p, h, layer(h))`; "
        "a `torch.rand(())` given no traced tensor runs once, like a Python draw, and a "
        "Python `if` on a tensor cannot be traced), then profile again")


def _innermost(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else ""


def _concrete_args(model: torch.nn.Module, n_inputs: int) -> dict[str, Any] | None:
    """Parameters of forward beyond the positional inputs are fixed to their defaults."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    out: dict[str, Any] = {}
    for p in params[n_inputs:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is p.empty:
            raise PipeplanError(
                f"{type(model).__name__}.forward needs argument {p.name!r} but make_batch gives "
                f"only {n_inputs} input(s); return every required forward argument in inputs"
            )
        out[p.name] = p.default
    return out


def _inline_concrete_args(graph: fx.Graph, n_inputs: int) -> None:
    """fx keeps a placeholder (and a guard) for each argument fixed by `concrete_args`; the
    stages only receive the positional inputs, so put the fixed value in its place."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for p in placeholders[n_inputs:]:
        value = p.args[0] if p.args else None
        for user in list(p.users):
            user.args = fx.node.map_arg(user.args, lambda a, p=p, v=value: v if a is p else a)
            user.kwargs = fx.node.map_arg(user.kwargs, lambda a, p=p, v=value: v if a is p else a)
        graph.erase_node(p)


def _warn_leaf(model: torch.nn.Module, path: str, reason: str) -> None:
    kind = type(model.get_submodule(path)).__name__
    warnings.warn(
        f"{path} ({kind}) is measured and run as one piece, not split into its submodules: "
        f"{reason}", TracingWarning, stacklevel=4,
    )


_PLAIN = (int, float, bool, str, type(None))


def _state(model: torch.nn.Module) -> tuple[dict[str, int | None], dict[tuple[str, str], object]]:
    """What a forward may change behind the tracer's back: each parameter's and buffer's
    version counter (an in-place op on the tensor itself moves it), and each module's plain
    Python attributes (counters, flags)."""
    versions = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        versions[name] = getattr(t, "_version", None)
    plain = {(path, k): v for path, m in model.named_modules() for k, v in vars(m).items()
             if not k.startswith("_") and isinstance(v, _PLAIN)}
    return versions, plain


def _shown(value: object) -> str:
    return repr(value) if isinstance(value, _PLAIN) else f"a {type(value).__name__}"


def _check_untraced_changes(model: torch.nn.Module, before: tuple[dict, dict],
                            original: tuple[dict, dict]) -> None:
    """After fx traced `model`: a tensor of the model changed in place by an operation on it
    alone (`self.count.add_(1)`, `self.ema.mul_(0.9)` in the forward being traced) ran once,
    while tracing, and is in no graph: the pipeline would never run it, single-device training
    does on every step. Refused. A plain Python attribute the forward changed (a step counter,
    a flag; set to a traced value or a tensor counts too) gets a warning: the forward is traced
    once, so that state and the control flow that reads it stay as they were then. `before` is
    the state when the successful trace began (a failed attempt may have run code that the
    retry calls whole, as a leaf); every Python attribute is put back as in `original`."""
    versions, plain = _state(model)
    changed = [n for n, v in before[0].items() if v is not None and versions.get(n) != v]
    if changed:
        raise PipeplanError(
            f"{type(model).__name__}.forward changes {', '.join(changed[:5])} in place outside any "
            "layer, with an operation torch.fx runs once while tracing and does not record: "
            "pipeline stages would never run it, where single-device training does on every "
            "step. Make the update inside a module the model calls whole (a block, or a leaf "
            "such as the layer that produces the value), or compute the new value from the "
            "forward's inputs")
    for (path, k), first in original[1].items():
        m = model.get_submodule(path)
        old = before[1].get((path, k), first)
        new = vars(m).get(k, first)
        if new is not first:
            setattr(m, k, first)  # tracing leaves the user's model as it was
        # (a traced value compares to a Proxy: only plain values are compared)
        if new is not old and (not isinstance(new, _PLAIN) or new != old):
            warnings.warn(
                f"{path + '.' if path else ''}{k} (a Python attribute of {type(m).__name__}) "
                f"changed while tracing ({old!r} -> {_shown(new)}): the forward is traced once, so this "
                "state, and any control flow that reads it, stays as it was then in pipeline "
                "training; keep state that changes in tensors inside a layer", TracingWarning,
                stacklevel=4)


def _try_fx(model: torch.nn.Module, n_inputs: int, given: set[str]
            ) -> tuple[fx.GraphModule | None, list[str], str]:
    original = _state(model)
    leaves: set[str] = set(given)
    split = set(_split_hooked(model, given))
    for path, m in model.named_modules():
        if path in leaves or any(path.startswith(p + ".") for p in leaves) or not _has_hooks(m):
            continue
        if path in split and path and not (m._backward_hooks or getattr(m, "_backward_pre_hooks", None)):
            # called through Module.__call__ while tracing: its forward (pre-)hooks are traced
            # into the graph like the rest of its forward
            warnings.warn(
                f"{path} ({type(m).__name__}) has forward hooks and holds modules that are split "
                "between pipeline stages: the hooks were traced into the graph, so their tensor "
                "operations run in pipeline training, but their Python side effects (counters, "
                "prints, attributes they set) ran once, while tracing (put such hooks on the "
                "blocks or the modules inside)", TracingWarning, stacklevel=3,
            )
        elif path in split:
            warnings.warn(
                f"{path or 'the model'} ({type(m).__name__}) has hooks, but it holds modules that "
                "are split between pipeline stages, so no stage calls it and its hooks do not run "
                "in pipeline training (put them on the blocks or the modules inside)",
                TracingWarning, stacklevel=3,
            )
        elif not fx.Tracer().is_leaf_module(m, path):
            leaves.add(path)
            _warn_leaf(model, path, "it has hooks, which run only when the module is called whole")
    last_error = ""
    for _ in range(MAX_AUTO_LEAVES + 1):
        tracer = _Tracer(leaves)
        before = _state(model)
        try:
            with _functions_are_opaque(), _glue_draws([]) as drew:
                graph = tracer.trace(model, concrete_args=_concrete_args(model, n_inputs))
        except PipeplanError:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing failure triggers the fallbacks
            last_error = first_line(f"{type(exc).__name__}: {exc}")
            failing = [p for p, _ in tracer.module_stack.values() if isinstance(p, str) and p]
            if isinstance(exc, _Opaque) and not failing:
                # in the model's own forward: no module to call whole, and torch.export would
                # keep the Function's forward ops and drop its backward (wrong gradients)
                if str(exc) == _CONTEXT:
                    raise PipeplanError(
                        f"{type(model).__name__}.forward enters {exc} itself; pipeline stages "
                        "would run the code inside without it. Move the `with` block into a "
                        "small nn.Module, called from the model's forward: a module is run as "
                        "written, its context included") from None
                raise PipeplanError(
                    f"{type(model).__name__}.forward applies a {exc} itself; pipeline stages can "
                    "run a custom Function only inside a submodule, called as written. Move the "
                    "call into a small nn.Module (forward: return YourFunction.apply(...)) and "
                    "call that module from the model's forward") from None
            if not failing or failing[-1] in leaves:
                return None, sorted(leaves - given), last_error
            leaves.add(failing[-1])
            reason = ((f"it enters {exc}" if str(exc) == _CONTEXT else f"it applies a {exc}")
                      if isinstance(exc, _Opaque) else f"torch.fx cannot trace its code ({last_error})")
            _warn_leaf(model, failing[-1], reason)
            continue
        _refuse_glue_draws(model, drew)
        _inline_concrete_args(graph, n_inputs)
        _check_untraced_changes(model, before, original)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return gm, sorted(leaves - given), ""
    return None, sorted(leaves - given), last_error


def _try_export(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                keep: list[str] | None = None) -> tuple[Any, str]:
    """Export; the modules in `keep` are swapped back in as the user's own objects."""
    quiet = [logging.getLogger(n) for n in ("torch", "torch.fx", "torch._dynamo", "torch.export")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    kept = [model.get_submodule(k) for k in keep or ()]
    try:
        with (contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings(),
              _glue_draws(kept) as drew):
            warnings.simplefilter("ignore")  # export's own notes on get_attr nodes and specs
            ep = torch.export.export(model, tuple(inputs), strict=False,
                                     preserve_module_call_signature=tuple(keep or ()))
            if keep:
                from torch.export._swap import _swap_modules

                gm = _swap_modules(ep, {k: model.get_submodule(k) for k in keep})
            else:
                gm = ep.module()
    except Exception as exc:  # noqa: BLE001
        return None, first_line(f"{type(exc).__name__}: {exc}")
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)
    _refuse_glue_draws(model, drew, "outside its blocks" if keep else
                       "(torch.export could not keep its blocks as calls, so their code is traced too)")
    return gm, ""


def _clean_export_graph(gm: fx.GraphModule) -> None:
    """Drop export's guard and metadata-assertion nodes (no effect on values)."""
    for node in list(reversed(gm.graph.nodes)):
        name = getattr(node.target, "__name__", str(node.target))
        is_guard = node.op == "call_module" and node.target == "_guards_fn"
        is_assert = node.op == "call_function" and any(d in name for d in _DROP_TARGETS)
        if (is_guard or is_assert) and not node.users:
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


EXPORT_RTOL = 1e-3  # largest difference to the model's outputs and gradients, relative to their size


def _tolerance(dtype: torch.dtype) -> float:
    """EXPORT_RTOL, or four steps of a low-precision float (a bfloat16 Llama's exported graph
    sums its backward in another order: 0.0105-0.0118 of a gradient's size, one bfloat16 step of
    7.8e-3, while the graph was right; an outside review)."""
    return max(EXPORT_RTOL, 4 * torch.finfo(dtype).eps) if dtype.is_floating_point else EXPORT_RTOL


def no_generation_cache(model: torch.nn.Module) -> bool:
    """Turn off `use_cache` on the `transformers` models in `model` (at their default, True, a
    causal or seq2seq model returns a DynamicCache / EncoderDecoderCache, which no trace can
    carry: every such model at its default config was refused, with advice that did not apply).
    Training never reads the cache, so the trained weights are the same. True if one was on."""
    changed = False
    for mod in _transformers_models(model):
        if getattr(mod.config, "use_cache", None) is True:
            mod.config.use_cache = False
            changed = True
    return changed


def _transformers_models(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The `transformers` models in `model` (itself, or held by a module of the user's; a
    subclass defined in the model file too), where the model file imported transformers."""
    tf = sys.modules.get("transformers")
    base = getattr(tf, "PreTrainedModel", None) if tf is not None else None
    if base is None:
        return []
    return [m for m in model.modules() if isinstance(m, base) and getattr(m, "config", None) is not None]


def _run_with_grads(fn: Any, inputs: tuple[torch.Tensor, ...], params: dict[str, torch.Tensor]
                    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """`fn(*inputs)` from one RNG seed, then the backward of a fixed random weighting of its
    floating outputs: (its tensor outputs, the gradient of each of `params` that got one)."""
    for t in params.values():
        t.grad = None
    cuda = sorted({t.device.index or 0 for t in inputs if isinstance(t, torch.Tensor) and t.is_cuda})
    with torch.random.fork_rng(devices=cuda):  # the caller's RNG states are left as they were
        torch.random.default_generator.manual_seed(0)
        for d in cuda:
            torch.cuda.default_generators[d].manual_seed(0)
        out = fn(*inputs)
    leaves = [v for v in pytree.tree_leaves(out) if isinstance(v, torch.Tensor)]
    diff = [v for v in leaves if v.requires_grad and v.is_floating_point()]
    if diff:
        g = torch.Generator().manual_seed(0)
        sum((v.float() * torch.rand(v.shape, generator=g).to(v.device)).sum() for v in diff).backward()
    grads = {k: t.grad.detach().clone() for k, t in params.items() if t.grad is not None}
    for t in params.values():
        t.grad = None
    return [v.detach() for v in leaves], grads


def _worst(a: list[torch.Tensor], b: list[torch.Tensor], names: list[str]) -> tuple[float, str, float]:
    """The largest difference of b from a, relative to a's size and in units of its dtype's
    tolerance (`_tolerance`), where, and that difference relative to a's size."""
    worst, where, size = 0.0, "", 0.0
    for x, y, name in zip(a, b, names, strict=True):
        if x.shape != y.shape or x.dtype != y.dtype:
            return float("inf"), name, float("inf")
        if not x.is_floating_point():
            d = 0.0 if torch.equal(x, y) else float("inf")
        else:
            d = float((x.double() - y.double()).abs().max()) / max(float(x.double().abs().max()), 1e-30) \
                if x.numel() else 0.0
        if d / _tolerance(x.dtype) > worst:
            worst, where, size = d / _tolerance(x.dtype), name, d
    return worst, where, size


def _check_export(model: torch.nn.Module, gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...],
                  what: str = "torch.export's graph", advice: str = "") -> None:
    """Refuse a graph (`what`, torch.export's by default) that does not compute what `model`
    computes on `inputs`: outputs and parameter gradients (from one RNG seed, so dropout draws
    alike) against the model's own, where the model gives the same twice; the model's buffers and
    gradients are left as they were. `advice` ends the error (the export advice by default)."""
    advice = advice or _EXPORT_ADVICE
    own = dict(model.named_parameters())
    theirs = {k: t for k, t in gm.named_parameters() if k in own}
    buffers = [(b, b.detach().clone()) for b in (*model.buffers(), *gm.buffers())]
    grads = {id(t): (t, t.grad) for t in (*own.values(), *theirs.values())}
    name = type(model).__name__

    def restore_buffers() -> None:  # each run starts from the model's statistics
        with torch.no_grad():
            for b, old in buffers:
                b.copy_(old)

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref_out, ref_grads = _run_with_grads(model, inputs, own)
            restore_buffers()
            again_out, again_grads = _run_with_grads(model, inputs, own)
            restore_buffers()
            try:
                # fx's GraphModule prints the graph's frames to stderr before it re-raises (28
                # lines ahead of the one-line error); the model's own two runs above printed
                # whatever the model prints
                with contextlib.redirect_stderr(io.StringIO()):
                    out, got = _run_with_grads(gm, inputs, theirs)
            except Exception as exc:  # noqa: BLE001 - any failure of the graph is the model's to fix
                raise PipeplanError(
                    f"{what} of {name} fails where the model runs "
                    f"({first_line(f'{type(exc).__name__}: {exc}')}): {advice}") from None
    finally:
        restore_buffers()
        for t, g in grads.values():
            t.grad = g
    keys = sorted(set(ref_grads) & set(got) & set(again_grads))
    names = [f"output {i}" for i in range(len(ref_out))] + [f"the gradient of {k}" for k in keys]
    ref = ref_out + [ref_grads[k] for k in keys]
    if len(out) != len(ref_out) or _worst(ref, again_out + [again_grads[k] for k in keys], names)[0] > 0:
        if len(out) != len(ref_out):
            raise PipeplanError(f"{what} of {name} returns {len(out)} tensors where "
                                f"the model returns {len(ref_out)}: {advice}")
        return  # the model itself differs from run to run (nondeterministic kernels): no reference
    over, where, d = _worst(ref, out + [got[k] for k in keys], names)
    if over > 1:
        raise PipeplanError(
            f"{what} of {name} does not compute what the model computes ({where} "
            f"differs by {d:.3g} of its size): {advice}")


_EXPORT_ADVICE = (
    "the model's top-level forward could not be traced by torch.fx, and torch.export records "
    "only the tensor operations of it, not what it does besides (a hook registered on a tensor "
    "with register_hook, a Python number or other non-tensor argument passed to a block, a "
    "side effect; or a block's tuple unpacked into the next block, `block(*out)`, whose parts "
    "torch.export's kept calls pass in another order). Make the top-level forward traceable by "
    "torch.fx (no data-dependent Python control flow such as `if h.requires_grad:`, no `*` on "
    "a block's outputs: `block(out[0], out[1])`), or move that code inside one of the blocks "
    "(a submodule runs as written), then profile again.")


HOOKED_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")


def _transformers_hint(model: torch.nn.Module) -> str:
    """Where a `transformers` model's config asks for outputs its layers' hooks collect (hidden
    states, attentions, router logits: a Llama, BERT or Mixtral so configured failed its export
    check with an IndexError, the advice naming nothing the user could change; an outside
    review), what to change."""
    flags = sorted({f for mod in _transformers_models(model) for f in HOOKED_OUTPUTS
                    if getattr(mod.config, f, None) is True})
    if not flags:
        tf = sys.modules.get("transformers")
        if tf is not None and isinstance(model, getattr(tf, "PreTrainedModel", ())):
            # a transformers class is not the user's to edit: what they can do instead (a bare
            # T5 was refused with advice to change its forward; wrapped, it trains in stages)
            return (f" {type(model).__name__} is a transformers class: rather than change its "
                    "forward, wrap it in a module of your own whose forward calls it with keywords "
                    "and returns what the loss needs (e.g. `.logits`), build that in build_model(), "
                    "then profile again: its parts are then called as written.")
        return ""
    return (f" This transformers model's config sets {', '.join(flags)}, outputs it collects with "
            "hooks on its layers, which a traced graph does not keep: set "
            f"{' and '.join(f'{f}=False' for f in flags)} in the config that build_model() makes "
            "(compute what the loss needs from the model's other outputs), then profile again.")


def _paths(gm: fx.GraphModule) -> dict[str, str]:
    return {n.name: (str(n.target) if n.op == "call_module" else _innermost(n)) for n in gm.graph.nodes}


def capture(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...],
            leaves: set[str] | None = None, keep: list[str] | None = None,
            check: bool = True, method: str | None = None) -> Traced:
    """Trace `model` called with `example_inputs` (its positional arguments), calling the
    modules in `leaves` rather than tracing into them; should fx fail, torch.export keeps the
    modules in `keep` (the blocks) as calls to the user's objects. `check`: an exported graph
    is run beside the model (`_check_export`; off where that was done before, e.g. a rank
    tracing from its launcher's record, which runs no user code). `method`: how that record's
    trace went ("fx" or "export"), where the choice depends on a check this one skips."""
    given = set(leaves or ())
    no_generation_cache(model)
    with warnings.catch_warnings(record=True) as fx_warnings:
        warnings.simplefilter("always")
        gm, auto, fx_error = _try_fx(model, len(example_inputs), given)
    if (gm is not None and keep and method != "fx"
            and any(k.startswith(a + ".") for a in auto for k in keep)):
        # fx got through only by calling a module that holds blocks whole (a Hugging Face model
        # inside a wrapper of the user's): torch.export may keep those blocks as calls instead,
        # so stages can start at them; its graph is used only where it computes what the model
        # does (checked where `check`: the launcher's and the profiler's trace; a rank tracing
        # from the launcher's record takes the launcher's choice, `method`), else fx's stands,
        # the module one layer, with fx's warnings
        egm, _ = _try_export(model, example_inputs, list(keep))
        if egm is not None:
            _clean_export_graph(egm)
            try:
                if check:
                    _check_export(model, egm, example_inputs)
            except PipeplanError:
                pass
            else:
                return Traced(gm=egm, method="export", paths=_paths(egm), out_spec=None,
                              leaves=list(keep))
    for w in fx_warnings:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if gm is not None:
        hooked = _split_hooked(model, given)
        if check and hooked:
            where = ", ".join(p or "the model" for p in hooked)
            _check_export(model, gm, example_inputs, "the pipeline's graph", (
                f"hooks on {where} change what it computes, and no pipeline stage calls "
                f"{'it' if len(hooked) == 1 else 'them'} whole, so they would not run. Move the "
                "hooks onto the blocks (or modules inside them), or do their work in forward, "
                "then profile again."))
        return Traced(gm=gm, method="fx", paths=_paths(gm), leaves=auto)
    export_error = ""
    if keep:
        egm, export_error = _try_export(model, example_inputs, list(keep))
        if egm is not None:
            _clean_export_graph(egm)
            if check:  # (what stopped fx is often the thing to change)
                _check_export(model, egm, example_inputs,
                              advice=f"{_EXPORT_ADVICE} torch.fx stopped at: {fx_error}"
                              f"{_transformers_hint(model)}")
            return Traced(gm=egm, method="export", paths=_paths(egm), out_spec=None, leaves=list(keep))
    egm, error2 = _try_export(model, example_inputs)
    if egm is not None and keep:
        warnings.warn(
            f"{type(model).__name__}: torch.export could not keep the blocks as calls to your "
            f"modules ({export_error}); they are traced into, so custom autograd Functions, "
            "hooks and buffer updates inside them will not run as written", TracingWarning,
            stacklevel=2,
        )
    export_error = error2 or export_error
    if egm is None:
        raise PipeplanError(
            f"cannot trace {type(model).__name__} into a graph.\n"
            f"  torch.fx symbolic tracing failed: {fx_error}\n"
            f"  torch.export failed: {export_error}\n"
            "Move the untraceable code (data-dependent Python control flow, calls on tensor "
            "values) out of the model's top-level forward into a submodule: a submodule that "
            "cannot be traced is then called as a whole and becomes part of one layer."
            f"{_transformers_hint(model)}"
        )
    _clean_export_graph(egm)
    if check:
        _check_export(model, egm, example_inputs, advice=_EXPORT_ADVICE + _transformers_hint(model))
    codegen = egm.graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    paths = {n.name: _innermost(n) for n in egm.graph.nodes}
    return Traced(gm=egm, method="export", paths=paths, out_spec=out_spec)
