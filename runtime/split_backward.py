"""A stage's backward in two autograd calls, for zero-bubble schedules: B (gradients of the
stage's inputs, what the previous stage waits for) and W (gradients of its weights, later).

Internal module. The method is torch.distributed.pipelining's `stage_backward_input` /
`stage_backward_weight` (torch/distributed/pipelining/_backward.py), whose graph helpers it
reuses: B runs `autograd.grad` from the outputs to the inputs with the graph retained, and on
the way records the gradient arriving at every "intermediate" node where a weight's branch
joins the input path; W runs `autograd.grad` from those intermediates to the weights, so no
node's backward runs twice. Differences from torch's: the outputs are not detached in place
(views cannot be); weights that no input path reaches (a stage whose inputs need no
gradient, or a branch from the parameters alone) get their gradients in W from the outputs
directly, with the graph B retained, instead of being left without a gradient; a weight
that reaches the input path and, by a branch of its own, an output that does not depend on the
inputs (`x * g` and `g.expand(...)` both returned; a T5 decoder block's position bias, made
from its own embedding, used in its attention and returned for the blocks after it) gets both
parts in one call of W, its group's intermediates and those outputs (`loose`): torch's split
drops the second (an outside review: 0.0024 on such a weight after 3 steps, 1F1B exact); and a
recomputed (checkpointed) stage computes all its weights' gradients that way (`direct`), which
runs the input-gradient part of the backward and the recomputation once more in W; so does a
stage whose B ran a module's forward (the user's own checkpoint recomputing), found in B.

GroupNorm on a channels_last input: torch's CPU kernel (2.13) segfaults in its backward when
asked for the weight's and bias's gradients without the input's, which is what W asks of a
GroupNorm on the input path (an outside review: `planner profile` exited 139 on a U-Net-like
conv + GroupNorm model, a ZB-H1 rank died of signal 11). B finds such nodes
(`_norm_input_edges`) and W asks for the gradient at each one's input edge too, which it
discards: the kernel then computes the input's gradient again (the node's own part, nothing
before it) and does not crash. A GroupNorm on a contiguous input is left as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    construct_reverse_graph,
    reverse_closure,
)


@dataclass
class PendingWeights:
    """What B leaves for W: the groups of intermediates with their gradients, and the weights
    W computes straight from the outputs."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_grads: list[torch.Tensor | None] = field(default_factory=list)  # None: a scalar's ones
    direct: list[torch.Tensor] = field(default_factory=list)  # weights outside every group
    # per group, the indices in `outputs` of the outputs that do not depend on the stage's
    # inputs and that the group's weights reach (the module docstring)
    loose: list[list[int]] = field(default_factory=list)
    recomputes: bool = False  # B ran a module's forward: the stage recomputes (a user's checkpoint)
    # per weight's node, the input edges of the channels_last GroupNorms it is an affine
    # parameter of: W asks for their gradients too (the module docstring)
    norm_edges: dict[Any, list[GradientEdge]] = field(default_factory=dict)


# torch 2.13's CPU kernel segfaults on a channels_last input with output_mask (False, True, *)
_NORM_NODES = frozenset({"NativeGroupNormBackward0"})


def _accumulate(weight: torch.Tensor, grad: torch.Tensor | None) -> None:
    """`weight.grad += grad` as autograd's AccumulateGrad does it, then the weight's
    post-accumulate hooks (`register_post_accumulate_grad_hook`: an optimizer stepped in the
    backward, a gradient scaled or clipped per weight), which autograd runs only where it
    accumulates itself: under ZB-H1 they never ran."""
    if grad is None:
        return
    if weight.grad is None:
        weight.grad = grad.detach().clone()
    else:
        weight.grad += grad
    hooks = getattr(weight, "_post_accumulate_grad_hooks", None)
    for hook in tuple(hooks.values()) if hooks else ():
        hook(weight)


def _layout_unsafe(node: Any) -> bool:
    """Whether a GroupNorm node's saved input is channels_last (not contiguous), read without
    unpacking it (a checkpointed one's would recompute); True where it cannot be read so."""
    try:
        packed = node._raw_saved_input.data
    except (AttributeError, RuntimeError):
        return True
    return not isinstance(packed, torch.Tensor) or not packed.is_contiguous()


def _weight_leaves(node: Any, limit: int = 16) -> list[Any]:
    """The weights' nodes (AccumulateGrad) behind a GroupNorm node's weight and bias edges,
    through a few ops (a cast) where the weight is not used as it is."""
    todo = [n for n, _ in node.next_functions[1:] if n is not None]
    seen: set[Any] = set()
    leaves = []
    while todo and len(seen) < limit:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if type(n).__name__ == "AccumulateGrad":
            leaves.append(n)
        else:
            todo.extend(m for m, _ in n.next_functions if m is not None)
    return leaves


def _graph_nodes(roots: Sequence[Any]) -> set[Any]:
    """Every node reachable from `roots`."""
    seen: set[Any] = set()
    todo = [n for n in roots if n is not None]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(m for m, _ in n.next_functions if m is not None)
    return seen


def _norm_input_edges(nodes: Any) -> dict[Any, list[GradientEdge]]:
    """Per weight's node, the input edges of the GroupNorm nodes among `nodes` that take it
    as weight or bias and a channels_last input needing a gradient (the module docstring)."""
    out: dict[Any, list[GradientEdge]] = {}
    for node in nodes:
        if type(node).__name__ not in _NORM_NODES:
            continue
        first, nr = node.next_functions[0]
        if first is None or not _layout_unsafe(node):
            continue
        for leaf in _weight_leaves(node):
            out.setdefault(leaf, []).append(GradientEdge(first, nr))
    return out


def _extra_edges(pending: PendingWeights, nodes: Sequence[Any]) -> list[GradientEdge]:
    """The GroupNorm input edges W asks for beside the weights `nodes`, each once."""
    edges: dict[tuple[int, int], GradientEdge] = {}
    for n in nodes:
        for e in pending.norm_edges.get(n, ()):
            edges.setdefault((id(e.node), e.output_nr), e)
    return list(edges.values())


def param_groups(inputs: list[Any], params: list[Any], reverse: dict[Any, Any]
                 ) -> tuple[list[dict[str, Any]], set[Any]]:
    """The weights' nodes grouped by the intermediates they reach on the input path (the nodes
    where a weight's branch meets it), two weights in one group where they share one, with each
    group's intermediates; and the input path's nodes. As torch's `get_param_groups` means to:
    its merge left a group that a later weight joined through a second intermediate in place
    beside the merged one, so that weight's gradient was computed twice, depending on the order
    a set of nodes was walked in (a fuzz of random graphs: 14 of 3,000 wrong, each about half the
    time). Here the groups are the connected components, each weight in one; each group also
    holds its weights' nodes off the input path ("reach"), where `backward_input` looks for
    their own branches to outputs."""
    closure, _ = reverse_closure(inputs, set(), reverse)
    hits: dict[Any, set[Any]] = {}
    reach: dict[Any, set[Any]] = {}  # each weight's nodes off the input path (its own branches)
    for p in params:
        mine, hit = reverse_closure([p], closure, reverse)
        if hit:
            hits[p], reach[p] = hit, mine
    parent = {p: p for p in hits}

    def find(p: Any) -> Any:
        while parent[p] is not p:
            parent[p] = parent[parent[p]]
            p = parent[p]
        return p

    first: dict[Any, Any] = {}  # intermediate -> the first weight that reached it
    for p, hit in hits.items():
        for n in hit:
            if n in first:
                a, b = find(p), find(first[n])
                if a is not b:
                    parent[a] = b
            else:
                first[n] = p
    members: dict[Any, list[Any]] = {}
    for p in hits:
        members.setdefault(find(p), []).append(p)
    groups = []
    for ps in members.values():
        inter: list[Any] = []
        seen: set[Any] = set()
        for p in ps:
            for n in hits[p]:
                if n not in seen:
                    seen.add(n)
                    inter.append(n)
        groups.append({"params": ps, "intermediates": inter,
                       "reach": set().union(*(reach[p] for p in ps))})
    return groups, closure


def backward_input(outputs: Sequence[torch.Tensor], output_grads: Sequence[torch.Tensor | None],
                   inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                   direct: bool = False) -> tuple[list[torch.Tensor | None], PendingWeights]:
    """B: the gradients of `inputs` (None where unused), and what W needs. `direct`: W computes
    every weight's gradient from the outputs (a recomputed stage: torch.utils.checkpoint's
    recomputation and the intermediates' gradients do not mix)."""
    outs = [o for o in outputs if o.requires_grad]
    grads = [g for o, g in zip(outputs, output_grads, strict=True) if o.requires_grad]
    weights = [w for w in weights if w.requires_grad]
    pending = PendingWeights(outputs=outs, output_grads=grads)
    grad_inputs = [x for x in inputs if x.requires_grad]
    if not outs:
        return [None] * len(inputs), pending
    if not grad_inputs or direct:
        pending.direct = list(weights)
        if not grad_inputs:  # (W asks for every weight: GroupNorm's masks as in one backward)
            return [None] * len(inputs), pending
        pending.norm_edges = _norm_input_edges(_graph_nodes([_get_grad_fn_or_grad_acc(o) for o in outs]))
        got = torch.autograd.grad(outs, grad_inputs, grads, retain_graph=True, allow_unused=True)
        by_id = {id(x): g for x, g in zip(grad_inputs, got, strict=True)}
        return [by_id.get(id(x)) for x in inputs], pending
    reverse = construct_reverse_graph([n for n in map(_get_grad_fn_or_grad_acc, outs) if n is not None])
    weight_nodes = {w: _get_grad_fn_or_grad_acc(w) for w in weights}
    input_nodes = [n for n in map(_get_grad_fn_or_grad_acc, grad_inputs) if n is not None]
    groups, closure = param_groups(input_nodes, [n for n in weight_nodes.values() if n is not None], reverse)
    pending.norm_edges = _norm_input_edges({*reverse, *map(_get_grad_fn_or_grad_acc, outs)})
    grouped = {n for g in groups for n in g["params"]}
    # outputs that do not depend on the inputs, which a grouped weight may also reach
    # (per node, every output it makes: the outputs of one op, `g.chunk(2)`, share a node)
    free: dict[Any, list[int]] = {}
    for k, o in enumerate(outs):
        node = _get_grad_fn_or_grad_acc(o)
        if node is not None and node not in closure:
            free.setdefault(node, []).append(k)
    for group in groups:
        reach = group.pop("reach")
        pending.loose.append(sorted(k for n, ks in free.items() if n in reach for k in ks))
    pending.direct = [w for w, n in weight_nodes.items() if n not in grouped and n in reverse]
    handles = []
    for group in groups:
        inter = list(group["intermediates"])
        group["intermediates"] = inter
        group["grads"] = [None] * len(inter)
        for i, node in enumerate(inter):
            def hook(grad_outputs: tuple[torch.Tensor | None, ...], group: dict[str, Any] = group,
                     i: int = i) -> None:
                group["grads"][i] = grad_outputs
            handles.append(node.register_prehook(hook))
    ran: list[int] = []  # modules called during B: a recomputation (the user's checkpoint)
    handles.append(torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: ran.append(1)))
    try:
        got = torch.autograd.grad(outs, grad_inputs, grads, retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    if ran:
        # the stage recomputes (the user's own torch.utils.checkpoint): each of W's calls per
        # group is a backward of its own and recomputes once more (11 forwards of a Llama block's
        # projections in one B + W, W 5x its price); one call from the outputs recomputes once
        pending.direct = [w for w, n in weight_nodes.items() if n in reverse]
        pending.loose = []
        pending.recomputes = True
    else:
        pending.groups = groups
    by_id = {id(x): g for x, g in zip(grad_inputs, got, strict=True)}
    return [by_id.get(id(x)) for x in inputs], pending


def held_tensors(pending: PendingWeights) -> list[torch.Tensor]:
    """The gradients `pending` keeps from B until W: the outputs' and the intermediates'."""
    out = [g for g in pending.output_grads if g is not None]
    for group in pending.groups:
        for grads in group["grads"]:
            out.extend(g for g in grads or () if isinstance(g, torch.Tensor))
    return out


def backward_weight(pending: PendingWeights, weights: Sequence[torch.Tensor]) -> None:
    """W: accumulate the weights' gradients into `.grad`; frees the graph."""
    node_to_weight = {_get_grad_fn_or_grad_acc(w): w for w in weights if w.requires_grad}
    for k_group, group in enumerate(pending.groups):
        edges: list[Any] = []
        grads: list[torch.Tensor | None] = []
        for grads_tuple, node in zip(group["grads"], group["intermediates"], strict=True):
            for i, g in enumerate(grads_tuple or ()):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    grads.append(g)
        loose = pending.loose[k_group] if k_group < len(pending.loose) else []
        edges += [pending.outputs[k] for k in loose]  # the group's own branches to outputs
        grads += [pending.output_grads[k] for k in loose]
        handles = []
        # each intermediate's node gets the gradients B captured, as they were: a descendant
        # intermediate must not count twice, and hooks on the tensors (`h.register_hook`), which
        # run before a node's pre-hooks and already ran in B, must not apply twice
        for grads_tuple, node in zip(group["grads"], group["intermediates"], strict=True):
            handles.append(node.register_prehook(lambda _g, saved=grads_tuple: saved))
        try:
            if edges:
                params = list(group["params"])
                targets = [GradientEdge(p, 0) for p in params] + _extra_edges(pending, params)
                dws = torch.autograd.grad(edges, targets, grad_outputs=grads, retain_graph=True,
                                          allow_unused=True)
                for p, dw in zip(params, dws[:len(params)], strict=True):  # (not the extra edges')
                    _accumulate(node_to_weight[p], dw)
        finally:
            for h in handles:
                h.remove()
    if pending.direct and pending.outputs:
        extra = _extra_edges(pending, [_get_grad_fn_or_grad_acc(w) for w in pending.direct])
        dws = torch.autograd.grad(pending.outputs, [*pending.direct, *extra], pending.output_grads,
                                  retain_graph=True, allow_unused=True)
        for w, dw in zip(pending.direct, dws[:len(pending.direct)], strict=True):
            _accumulate(w, dw)
    pending.groups.clear()
    pending.norm_edges.clear()
    pending.loose.clear()
    pending.outputs.clear()
    pending.output_grads.clear()
