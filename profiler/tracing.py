"""Capture a model's computation as a torch.fx graph whose nodes know their module path.

Internal to `profiler.graph`. Strategy, in order:
1. `torch.fx` symbolic tracing (batch-size independent; leaf modules stay one call node);
2. if tracing fails inside a submodule, that submodule becomes a leaf (it is called as a whole,
   so its untraceable code never gets traced) and tracing is retried;
3. if it fails at the top level, `torch.export` (non-strict), which handles code symbolic
   tracing cannot (decorators, `**kwargs`, Python containers) but specialises on shapes.
Each node's module path is the innermost entry of `node.meta["nn_module_stack"]` ("" for code
in the root's own forward).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from planner.errors import PipeplanError

MAX_AUTO_LEAVES = 32

_DROP_TARGETS = {"_assert_tensor_metadata", "_assert_async", "_assert_scalar", "sym_constrain_range_for_size"}


@dataclass
class Traced:
    gm: fx.GraphModule
    method: str  # "fx" or "export"
    paths: dict[str, str]  # node name -> innermost module path ("" = root forward)
    out_spec: Any = None  # export only: pytree spec of the model output
    leaves: list[str] = field(default_factory=list)  # modules made leaves to make tracing work


class _Tracer(fx.Tracer):
    def __init__(self, extra_leaves: set[str]) -> None:
        super().__init__()
        self.extra_leaves = extra_leaves

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return qualname in self.extra_leaves or super().is_leaf_module(m, qualname)


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


def _try_fx(model: torch.nn.Module, n_inputs: int) -> tuple[fx.GraphModule | None, list[str], str]:
    leaves: set[str] = set()
    last_error = ""
    for _ in range(MAX_AUTO_LEAVES + 1):
        tracer = _Tracer(leaves)
        try:
            graph = tracer.trace(model, concrete_args=_concrete_args(model, n_inputs))
        except PipeplanError:
            raise
        except Exception as exc:  # noqa: BLE001 - any tracing failure triggers the fallbacks
            last_error = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
            failing = [p for p, _ in tracer.module_stack.values() if isinstance(p, str) and p]
            if not failing or failing[-1] in leaves:
                return None, sorted(leaves), last_error
            leaves.add(failing[-1])
            continue
        _inline_concrete_args(graph, n_inputs)
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return gm, sorted(leaves), ""
    return None, sorted(leaves), last_error


def _try_export(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, str]:
    quiet = [logging.getLogger(n) for n in ("torch", "torch.fx", "torch._dynamo", "torch.export")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # export prints failing graphs
            ep = torch.export.export(model, tuple(inputs), strict=False)
            gm = ep.module()
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    finally:
        for lg, level in zip(quiet, levels, strict=True):
            lg.setLevel(level)
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


def capture(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...]) -> Traced:
    """Trace `model` called with `example_inputs` (its positional arguments)."""
    gm, leaves, fx_error = _try_fx(model, len(example_inputs))
    if gm is not None:
        paths = {n.name: (n.target if n.op == "call_module" else _innermost(n)) for n in gm.graph.nodes}
        return Traced(gm=gm, method="fx", paths=paths, leaves=leaves)
    egm, export_error = _try_export(model, example_inputs)
    if egm is None:
        raise PipeplanError(
            f"cannot trace {type(model).__name__} into a graph.\n"
            f"  torch.fx symbolic tracing failed: {fx_error}\n"
            f"  torch.export failed: {export_error}\n"
            "Move the untraceable code (data-dependent Python control flow, calls on tensor "
            "values) out of the model's top-level forward into a submodule: a submodule that "
            "cannot be traced is then called as a whole and becomes part of one layer."
        )
    _clean_export_graph(egm)
    codegen = egm.graph._codegen
    out_spec = getattr(getattr(codegen, "pytree_info", None), "out_spec", None)
    paths = {n.name: _innermost(n) for n in egm.graph.nodes}
    return Traced(gm=egm, method="export", paths=paths, out_spec=out_spec)
