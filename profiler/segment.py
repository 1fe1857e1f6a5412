"""Group a traced fx graph's nodes into layers (internal to `profiler.graph`).

Each node gets a *group key* from its module path and the granularity:
- `blocks`: the model's natural blocks — the elements of the outermost ModuleList/Sequential
  whose elements are themselves composite modules (a transformer's blocks, a UNet's stages);
  runs of other modules between them (embeddings, final norm + head, a UNet's middle) each
  form one layer;
- `modules`: every leaf module call;
- `depth:N`: module paths truncated to N components;
- `split:A,B,...` (`--split-points`): the `blocks` layers merged into runs, a new layer starting
  at each named module (as torchtitan's `pipeline_parallel_split_points`).
At `blocks` and `split`, the blocks and the modules outside them are fx leaves (called as the
user wrote them, see `leaf_modules`); only the code between them is traced.
Code outside those modules ("glue": adds, reshapes, masks, getattr) has no key. Layers are
contiguous runs of the graph's (topological) node order, so the layer order is topological.
A glue node joins the layer of its latest producer; glue with no computed producer (parameter
reads, code derived only from model inputs) joins the first layer that uses it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from planner.errors import PipeplanError
from profiler.tracing import TracingWarning

RUN = "~run"  # group key shared by consecutive non-block modules
_RANDOM = re.compile(r"rand|dropout|bernoulli|normal|multinomial|poisson|uniform", re.IGNORECASE)


@dataclass
class Segment:
    key: str
    nodes: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)  # distinct module paths, in order


SPLIT_PREFIX = "split:"


def parse_granularity(granularity: str) -> tuple[str, int]:
    if granularity in ("blocks", "modules"):
        return granularity, 0
    m = re.fullmatch(r"depth:(\d+)", granularity)
    if m and int(m.group(1)) >= 1:
        return "depth", int(m.group(1))
    if granularity.startswith(SPLIT_PREFIX) and split_points(granularity):
        return "split", 0
    raise PipeplanError(
        f"granularity {granularity!r}: use 'blocks' (natural blocks), 'modules' (every leaf "
        "module), 'depth:N' (module paths cut to N components, N >= 1) or 'split:A,B' "
        "(--split-points: layers start at the named modules)"
    )


def split_granularity(points: list[str]) -> str:
    """The granularity string of `--split-points A,B` (recorded in the profile and the plan)."""
    return SPLIT_PREFIX + ",".join(p.strip() for p in points if p.strip())


def split_points(granularity: str) -> list[str]:
    if not granularity.startswith(SPLIT_PREFIX):
        return []
    return [p.strip() for p in granularity[len(SPLIT_PREFIX):].split(",") if p.strip()]


def leaf_modules(model: torch.nn.Module, granularity: str) -> set[str]:
    """Modules the tracer must call rather than trace into: at `blocks`/`split`, the natural
    blocks and every module outside them (only the glue between them is traced); none else."""
    mode, _ = parse_granularity(granularity)
    if mode not in ("blocks", "split"):
        return set()
    blocks, ancestors = natural_blocks(model)
    leaves = set(blocks)
    for name, _ in model.named_modules():
        if name and name not in ancestors and _top_outside(name, ancestors) == name:
            leaves.add(name)
    if mode == "split":
        modules = dict(model.named_modules())
        for point in split_points(granularity):
            if point not in modules:
                near = [n for n in sorted(leaves) if n.rsplit(".", 1)[0] == point.rsplit(".", 1)[0]][:5]
                raise PipeplanError(
                    f"--split-points: the model has no module {point!r} (modules at the block "
                    f"level: {', '.join(near or sorted(leaves)[:8])})"
                )
            inside = [leaf for leaf in leaves if point.startswith(leaf + ".")]
            if inside:
                raise PipeplanError(
                    f"--split-points: {point!r} is inside the block {inside[0]!r}; a split point "
                    f"must be a block or a module outside the blocks, e.g. {sorted(leaves)[:6]}"
                )
    return leaves


def _is_block_list(m: torch.nn.Module) -> bool:
    """A ModuleList / Sequential of at least two blocks: modules with submodules of their own,
    or modules of the user's own classes holding parameters directly (a block written with
    nn.Parameter and F.linear; a Sequential of torch.nn layers, Linear, ReLU, ..., is one
    layer's parts, not blocks)."""
    kids = list(m.children())
    return (
        isinstance(m, torch.nn.ModuleList | torch.nn.Sequential)
        and len(kids) >= 2
        and sum(1 for k in kids if _is_block(k)) >= 2
    )


def _is_block(k: torch.nn.Module) -> bool:
    if any(True for _ in k.children()):
        return True
    return (not type(k).__module__.startswith("torch.")
            and any(True for _ in k.parameters(recurse=False)))


def _opaque(m: torch.nn.Module, path: str) -> bool:
    """A module torch.fx calls whole rather than tracing into (a torch.nn built-in such as
    nn.TransformerEncoder, whose inner layers were taken for blocks: the encoder stayed one
    node, counted as glue, and the whole model became one layer named after its head)."""
    containers = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)
    return not isinstance(m, containers) and fx.Tracer().is_leaf_module(m, path)


def natural_blocks(model: torch.nn.Module) -> tuple[list[str], set[str]]:
    """(block paths, paths of their ancestors). Fallback: the root's children are the blocks."""
    blocks: list[str] = []
    ancestors: set[str] = set()

    def visit(m: torch.nn.Module, prefix: str) -> bool:
        found = False
        if _is_block_list(m):
            blocks.extend(f"{prefix}{name}" for name, _ in m.named_children())
            found = True
        else:
            for name, child in m.named_children():
                if _opaque(child, f"{prefix}{name}"):
                    continue  # traced whole (a torch.nn built-in): no stage runs a part of it
                found |= visit(child, f"{prefix}{name}.")
        if found:
            ancestors.add(prefix[:-1])
        return found

    if not visit(model, ""):
        blocks = [name for name, _ in model.named_children()]
        ancestors = {""}
    ancestors.add("")
    return blocks, ancestors


def _under(path: str, roots: set[str]) -> str | None:
    parts = path.split(".") if path else []
    for i in range(len(parts), 0, -1):
        p = ".".join(parts[:i])
        if p in roots:
            return p
    return None


def _top_outside(path: str, ancestors: set[str]) -> str:
    """The shortest prefix of `path` that is not an ancestor of a block."""
    parts = path.split(".")
    for i in range(1, len(parts) + 1):
        p = ".".join(parts[:i])
        if p not in ancestors:
            return p
    return path


def group_keys(
    gm: fx.GraphModule, model: torch.nn.Module, paths: dict[str, str], granularity: str
) -> tuple[dict[str, str | None], dict[str, str]]:
    """(group key per compute node name (None = glue), label: the module path naming it)."""
    mode, depth = parse_granularity(granularity)
    modules = dict(model.named_modules())
    blocks, ancestors = natural_blocks(model) if mode in ("blocks", "split") else ([], set())
    block_set = set(blocks)
    keys: dict[str, str | None] = {}
    labels: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        p = paths.get(node.name, "")
        is_leaf = node.op == "call_module" or (p in modules and not any(True for _ in modules[p].children()))
        key: str | None
        label = p
        if mode in ("blocks", "split"):
            b = _under(p, block_set)
            if b is not None:
                key = label = b
            elif p in ancestors and node.op == "call_module":
                # a module holding blocks that the trace calls whole (torch.fx could not trace
                # into it: a wrapped Hugging Face model): a layer of its own, under its own name
                # (as glue it went into the next layer, named after that one: the whole of
                # GPT2Model inside a layer called "lm.lm_head")
                key = label = p
            elif p in ancestors:
                key = None
            else:
                key, label = RUN, _top_outside(p, ancestors)
        elif mode == "modules":
            key = p if (p and is_leaf) else None
        else:
            parts = p.split(".") if p else []
            key = label = ".".join(parts[:depth]) if (len(parts) >= depth or (p and is_leaf)) else None
        keys[node.name] = key
        if key is not None:
            labels[node.name] = label or ""
    return keys, labels


def merge_at_split_points(segs: list[Segment], owner: dict[str, int],
                          points: list[str]) -> tuple[list[Segment], dict[str, int]]:
    """Join consecutive segments into one layer per run that starts at a split point."""
    if not points:
        return segs, owner
    starts = set(points)

    def starts_here(seg: Segment) -> bool:
        return any(p == s or p.startswith(s + ".") for p in seg.paths for s in starts)

    found = {s for seg in segs for s in starts if any(p == s or p.startswith(s + ".") for p in seg.paths)}
    missing = [s for s in points if s not in found]
    inside = [(s, p) for s in missing for seg in segs for p in seg.paths if p and s.startswith(p + ".")]
    if inside:
        s, p = inside[0]
        raise PipeplanError(
            f"--split-points: {s!r} runs inside {p}, which is traced as one piece (torch.fx cannot "
            "trace its code: see the warning above), so no layer starts there. Split at "
            f"{p} or around it, or make the model traceable: call {p}'s submodules from a "
            "forward of your own, or give the profiler a model torch.export can capture")
    if missing:
        raise PipeplanError(
            f"--split-points: {', '.join(map(repr, missing))} never runs in the model's forward; "
            f"layers that do: {', '.join(p for seg in segs for p in seg.paths[:1])}"
        )
    merged: list[Segment] = []
    remap: dict[int, int] = {}
    for i, seg in enumerate(segs):
        if merged and not starts_here(seg):
            m = merged[-1]
            m.key = f"{m.key}|{seg.key}"
            m.nodes.extend(seg.nodes)
            m.paths.extend(p for p in seg.paths if p not in m.paths)
        else:
            merged.append(Segment(seg.key, list(seg.nodes), list(seg.paths)))
        remap[i] = len(merged) - 1
    return merged, {n: remap[s] for n, s in owner.items()}


def is_random(node: fx.Node) -> bool:
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", str(node.target))
    return bool(_RANDOM.search(str(name)))


def classify(gm: fx.GraphModule, is_tensor: dict[str, bool]) -> dict[str, str]:
    """Per node: input | attr | free (derived from inputs only: recomputed where needed) |
    recompute (a non-tensor value recomputed where needed) | value (a tensor, or a non-tensor
    that cannot be recomputed) | output."""
    kind: dict[str, str] = {}
    for node in gm.graph.nodes:
        ins = [a.name for a in node.all_input_nodes]
        if node.op == "placeholder":
            kind[node.name] = "input"
        elif node.op == "output":
            kind[node.name] = "output"
        elif node.op == "get_attr":
            kind[node.name] = "attr"
        elif node.op in ("call_function", "call_method") and not is_random(node):
            if all(kind[i] in ("input", "free") for i in ins):
                kind[node.name] = "free"
            elif (
                not is_tensor.get(node.name, True)
                and not str(node.target).endswith("_")
                and all(kind[i] != "value" or is_tensor.get(i, True) for i in ins)
            ):
                kind[node.name] = "recompute"
            else:
                kind[node.name] = "value"
        else:
            kind[node.name] = "value"
    return kind


def segment(gm: fx.GraphModule, keys: dict[str, str | None], kind: dict[str, str],
            labels: dict[str, str]) -> tuple[list[Segment], dict[str, int]]:
    """Split the node order into segments; return them and each node's segment index."""
    segs: list[Segment] = []
    owner: dict[str, int] = {}
    deferred: list[fx.Node] = []
    nodes = list(gm.graph.nodes)
    for node in nodes:
        k = kind[node.name]
        if k in ("input", "output"):
            continue
        key = keys.get(node.name)
        if key is not None:
            if not segs or segs[-1].key != key:
                segs.append(Segment(key))
            owner[node.name] = len(segs) - 1
            continue
        anchors = [owner[a.name] for a in node.all_input_nodes
                   if a.name in owner and kind[a.name] in ("value", "recompute")]
        if anchors:
            owner[node.name] = max(anchors)
        else:
            deferred.append(node)
    if not segs:
        segs.append(Segment("model"))
    for node in reversed(deferred):
        users = [owner[u.name] for u in node.users if u.name in owner]
        owner[node.name] = min(users) if users else 0
    for node in nodes:
        if node.name in owner:
            seg = segs[owner[node.name]]
            seg.nodes.append(node.name)
            p = labels.get(node.name)
            if p is not None and p not in seg.paths:
                seg.paths.append(p)
    return segs, owner


def merge_untransferable(segs: list[Segment], owner: dict[str, int], gm: fx.GraphModule,
                         kind: dict[str, str], is_tensor: dict[str, bool]) -> tuple[list[Segment], dict[str, int]]:
    """A non-tensor value that cannot be recomputed (a tuple returned by a module, ...) must not
    cross a layer boundary: merge the layers from its producer to its last consumer."""
    parent = list(range(len(segs)))
    said: list[str] = []
    for node in gm.graph.nodes:
        if kind[node.name] != "value" or node.name not in owner:
            continue
        s = owner[node.name]
        for u in node.users:
            t = owner.get(u.name, len(segs) - 1)
            if t != s and not is_tensor.get(node.name, True):
                for i in range(min(s, t) + 1, max(s, t) + 1):
                    parent[i] = parent[i - 1]
                if len(said) < 3:
                    said.append(f"{node.name!r} ({segs[s].key} -> {segs[t].key})")
    if said:
        warnings.warn(
            "values that are not tensors cross between layers, which are kept as one layer so no "
            f"cut falls between them: {', '.join(said)}{' and more' if len(said) == 3 else ''}. A "
            "block that returns a tuple, dict or None beside its tensors (e.g. a cache=None) "
            "makes its neighbours one layer: return only tensors, or compute such values in the "
            "block that uses them", TracingWarning, stacklevel=4)
    return _merged(segs, owner, gm, parent)


def merge_mutated(segs: list[Segment], owner: dict[str, int], gm: fx.GraphModule,
                  mutates: dict[str, list[str]]) -> tuple[list[Segment], dict[str, int]]:
    """A tensor modified in place (`mutates`: node -> the nodes whose tensors it modifies) keeps
    its producer, the node that modifies it and every node that reads it in one layer: the
    layers from the first of them to the last are merged. (Across layers, the modification
    would fail on a stage's input, a leaf of autograd, or a stage that read the tensor before
    or after it would see another value than in the whole model.)"""
    parent = list(range(len(segs)))
    by_name = {n.name: n for n in gm.graph.nodes}
    # fx reads a module's buffer or parameter anew at every use (`buf`, `buf_1`, ...): a
    # change through one of those nodes changes what all of them read (a top-level buffer
    # passed to every block that updates it in place)
    attrs: dict[str, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            attrs.setdefault(str(n.target), []).append(n)
    last = len(segs) - 1
    for name, targets in mutates.items():
        if name not in owner:
            continue
        involved = {owner[name]}
        for t in targets:
            node = by_name.get(t)
            if node is None:
                continue
            for same in attrs[str(node.target)] if node.op == "get_attr" else [node]:
                if same.name in owner:
                    involved.add(owner[same.name])
                involved.update(owner.get(u.name, last) for u in same.users)
        lo, hi = min(involved), max(involved)
        for i in range(lo + 1, hi + 1):
            parent[i] = parent[i - 1]
    return _merged(segs, owner, gm, parent)


def _merged(segs: list[Segment], owner: dict[str, int], gm: fx.GraphModule,
            parent: list[int]) -> tuple[list[Segment], dict[str, int]]:
    """Segments i with parent[i] != i joined to the one before them."""
    if parent == list(range(len(segs))):
        return segs, owner
    merged: list[Segment] = []
    remap: dict[int, int] = {}
    for i, seg in enumerate(segs):
        if parent[i] == i:
            merged.append(Segment(seg.key, list(seg.nodes), list(seg.paths)))
        else:
            m = merged[-1]
            m.key = f"{m.key}|{seg.key}"
            m.nodes.extend(seg.nodes)
            m.paths.extend(p for p in seg.paths if p not in m.paths)
        remap[i] = len(merged) - 1
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for m in merged:
        m.nodes.sort(key=order.__getitem__)
    return merged, {n: remap[s] for n, s in owner.items()}


def name_segments(segs: list[Segment], model: torch.nn.Module) -> list[tuple[str, str]]:
    """(name, kind) per segment: its module path (several joined by '+'), made unique."""
    modules = dict(model.named_modules())
    out: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    for seg in segs:
        labels = [p or "model" for p in seg.paths] or ["model"]
        name = "+".join(labels)
        kinds: list[str] = []
        for p in seg.paths or [""]:
            k = type(modules[p]).__name__ if p in modules else "ops"
            if k not in kinds:
                kinds.append(k)
        n = seen.get(name, 0) + 1
        seen[name] = n
        out.append((name if n == 1 else f"{name}#{n}", "+".join(kinds)))
    return out
