"""Tensor parallelism inside a pipeline stage, with torch's own `parallelize_module`.

Internal module. A model states how it is sharded as a TP plan: `{module-name pattern: style}`,
where a pattern is a dotted module name whose parts may hold `*` wildcards
(`blocks.*.attn.q`), and a style is one of

- `colwise`: `ColwiseParallel()`: the weight split by output feature; the output stays sharded
  along its last dimension (the next `rowwise` layer consumes it);
- `rowwise`: `RowwiseParallel()`: the weight split by input feature; partial outputs are summed
  (one all-reduce in forward, its input's gradient needs none);
- `colwise_rep` (aliases `vocab_head`, and transformers' `colwise_gather_output`): `ColwiseParallel(output_layouts=Replicate())`: like
  `colwise`, the output gathered whole (a vocabulary-parallel head in front of a plain loss);
- `rowwise_rep`: `RowwiseParallel(input_layouts=Replicate())`: like `rowwise` with a whole
  (replicated) input;
- `embedding` (aliases `vocab_embedding`, transformers' `embedding_rowwise`): `RowwiseParallel(input_layouts=Replicate())` on an
  `nn.Embedding`: the table split over the vocabulary, the lookups summed.

The plan comes from the model file's `tp_plan(model)` or, for a Hugging Face `transformers`
model, its own `base_model_tp_plan` (the base model's, under `base_model_prefix`) and `_tp_plan`.
A stage applies the entries that name its own modules (a stage module holds the user's module
objects under their original names), on a one-dimensional mesh over the ranks of its replica.
"""

from __future__ import annotations

import logging
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from planner.errors import PipeplanError

log = logging.getLogger(__name__)

STYLES = ("colwise", "rowwise", "colwise_rep", "rowwise_rep", "embedding",
          "vocab_embedding", "vocab_head", "colwise_gather_output", "embedding_rowwise")


def parallel_style(name: str) -> Any:
    """The torch ParallelStyle of a TP plan's style name."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_rep", "vocab_head", "colwise_gather_output"):
        return ColwiseParallel(output_layouts=Replicate())
    if name in ("rowwise_rep", "embedding", "vocab_embedding", "embedding_rowwise"):
        return RowwiseParallel(input_layouts=Replicate())
    raise PipeplanError(f"tensor-parallel plan: unknown style {name!r}; use one of {', '.join(STYLES)}")


def model_tp_plan(model: nn.Module, tp_plan_fn: Any = None) -> dict[str, str]:
    """The model's TP plan: the model file's `tp_plan(model)`, else a transformers model's own
    (`_tp_plan` of the model, `base_model_tp_plan` of its base model under its prefix)."""
    if tp_plan_fn is not None:
        plan = tp_plan_fn(model)
        if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in plan.items()):
            raise PipeplanError("tp_plan(model) must return a dict of module-name pattern -> style")
        return dict(plan)
    plan: dict[str, str] = {}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    for k, v in base.items():
        plan[f"{prefix}.{k}" if has_base else k] = v
    for k, v in (getattr(model, "_tp_plan", None) or {}).items():
        plan[k] = v
    return plan


def _matches(pattern: str, name: str) -> bool:
    p, n = pattern.split("."), name.split(".")
    return len(p) == len(n) and all(fnmatchcase(b, a) for a, b in zip(p, n, strict=True))


def resolve(plan: dict[str, str], module: nn.Module) -> dict[str, str]:
    """{module name in `module`: style} for every module a pattern of `plan` names."""
    out: dict[str, str] = {}
    for name, _ in module.named_modules():
        if not name:
            continue
        for pattern, style in plan.items():
            if _matches(pattern, name):
                out[name] = style
                break
    return out


def check_divisible(module: nn.Module, styles: dict[str, str], tp: int) -> None:
    """Every sharded dimension must split evenly over `tp` ranks (else results would differ)."""
    for name, style in styles.items():
        m = module.get_submodule(name)
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor):
            raise PipeplanError(f"tensor-parallel plan: {name} ({type(m).__name__}) has no weight to shard")
        if isinstance(m, nn.Embedding):
            dim = 0
        else:
            dim = 0 if style.startswith("colwise") or style == "vocab_head" else 1
        if w.shape[dim] % tp:
            raise PipeplanError(
                f"tensor-parallel degree {tp} does not divide {name}'s weight dimension {dim} "
                f"(size {w.shape[dim]}); choose a degree that divides it")


def parallelize(module: nn.Module, plan: dict[str, str], mesh: Any) -> dict[str, str]:
    """Shard `module`'s modules named by `plan` over the 1-D `mesh`; returns what was sharded."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = resolve(plan, module)
    # a module the stage does not call as a module (the tracer went through it: its weight is
    # read by the graph, e.g. transformers' embeddings) stays whole on every TP rank
    kept = {n: s for n, s in styles.items()
            if isinstance(module.get_submodule(n), nn.Linear | nn.Embedding)}
    if len(kept) != len(styles):
        log.warning("tensor parallelism: %s not sharded (the stage reads its weight directly, "
                    "not as an nn.Linear/nn.Embedding call); it stays whole on every TP rank",
                    ", ".join(sorted(set(styles) - set(kept))))
    styles = kept
    tied = {}
    for name in styles:
        for pname, p in module.get_submodule(name).named_parameters(recurse=False):
            tied.setdefault(id(p), []).append(f"{name}.{pname}")
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in tied and f"{n}" not in tied[id(p)]:
            raise PipeplanError(
                f"tensor parallelism: parameter {n} is tied to {tied[id(p)][0]}, which the TP plan "
                "shards; untie it or run this stage with tp 1")
    check_divisible(module, styles, mesh.size())
    if styles:
        parallelize_module(module, mesh, {k: parallel_style(v) for k, v in styles.items()})
    return styles


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def full(t: Any) -> Any:
    """The whole tensor of a DTensor (a collective over its mesh); other values as they are."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def like(value: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """`value` (a whole tensor) laid out as `ref` (a DTensor parameter: the same placements)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(ref, DTensor) and not isinstance(value, DTensor) and value.shape == ref.shape:
        return distribute_tensor(value.to(ref.device), ref.device_mesh, ref.placements)
    return value
