"""The layer graph of a model, and stage modules built from any set of its layers.

Public API (the runtime builds each rank's stage with it):

    lg = trace(model, example_inputs, granularity="blocks")      # -> LayerGraph
    lg.layer_names()                # layers in topological order (the units a cut may fall between)
    lg.graph                        # networkx.DiGraph over layer names; edge attrs `bytes` and
                                    # `tensors` {tensor id: bytes}; node attrs `index`, `kind`
    lg.edges()                      # the same as planner.formats.Edge list (model inputs included)
    lg.shared_parameters            # parameters held by several layers (tied weights)
    stage = build_stage(lg, ["h.0", "h.1"])                      # -> StageModule (nn.Module)
    out = stage({k: values[k] for k in stage.input_keys})        # dict: tensor id -> Tensor

Tensor ids: model inputs are "<input>:0", "<input>:1", ... (positional); the model's output is
"<output>" (whatever the model returns: a tensor, a tuple, a HF ModelOutput); every other value
is named by its fx node name, which is deterministic for a given model and tracing method. In
the profile, an edge's tensor is `edge.tensor` (this id) and its source the producing layer or
`planner.formats.INPUT_NODE` for model inputs.

At `blocks` and `split:` granularity the blocks and the modules around them are not traced
into: a StageModule calls the user's own module objects (`stage.get_submodule("h.0") is
model.h[0]`), so their code, custom autograd Functions, hooks and buffer updates run as written.
A StageModule holds only the parameters and buffers of its layers, under the same state-dict
keys as the original model (`build_model().load_state_dict(lg.complete_state_dict(merged))`
accepts the union of all stages' state dicts). `input_keys` are the tensor ids it needs (from
earlier layers or model inputs), `output_keys` those it produces that other layers or the final
output need. Running the stages of a partition in order, each fed the values produced so far,
reproduces `model(*inputs)` bit for bit. Non-tensor values never cross a stage boundary: values
derived only from model inputs (shapes, masks, position ids) and parameter reads are recomputed
in every stage that needs them; a non-tensor that cannot be recomputed (a tuple returned by a
module) keeps its producer and consumers in one layer. A parameter used by layers that end up
in different stages (tied weights) appears in each such stage and in `lg.shared_parameters`:
sum its gradient across those stages. After building its stage a rank should drop the
LayerGraph and the model, so that only its own parameters stay alive.

A tensor modified in place (`nn.ReLU(inplace=True)`, `x += y`, a block that changes its input)
stays in one layer with its producer and every node that reads it (`segment.merge_mutated`,
found by the version counters of the one run under no_grad); a change made through a view
(`x.view(-1).add_(1)`, `x[:, 0].zero_()`) counts for every live tensor on the same storage.

Limitations: models traced with `torch.export` (the fallback when torch.fx fails) are
specialised on the example inputs' shapes, so trace with the batch size you will run.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from planner.errors import PipeplanError
from planner.formats import INPUT_NODE, Edge
from profiler import segment as seg
from profiler.tracing import (
    Traced,
    TracingWarning,
    capture,
    global_rng_states,
    set_global_rng_states,
)

OUTPUT_KEY = "<output>"
OUT_SPEC_ATTR = "_pipeplan_out_spec"


def input_key(i: int) -> str:
    return f"{INPUT_NODE}:{i}"


@dataclass
class Layer:
    name: str
    kind: str  # module class names, for people
    nodes: list[str]  # fx node names this layer computes (in graph order)
    module_paths: list[str]


@dataclass
class SharedParameter:
    keys: list[str]  # state-dict keys (in different layers) that name one tensor
    layers: list[str]
    bytes: int = 0  # the tensor's size, held once by a stage with several of `layers`
    frozen: bool = False  # a parameter with requires_grad=False
    buffer: bool = False  # a buffer, not a parameter


@dataclass
class TensorInfo:
    id: str
    producer: str  # layer name or INPUT_NODE
    consumers: list[str]  # layer names, in order
    bytes: int


@dataclass
class LayerGraph:
    layers: list[Layer]
    graph: nx.DiGraph
    tensors: dict[str, TensorInfo]  # every value crossing a layer boundary (and model inputs)
    shared_parameters: list[SharedParameter]
    method: str  # "fx" or "export"
    granularity: str
    num_inputs: int
    # internals used by build_stage
    gm: fx.GraphModule = field(repr=False)
    root: torch.nn.Module = field(repr=False)
    kind: dict[str, str] = field(repr=False)
    owner: dict[str, int] = field(repr=False)
    alias_groups: list[list[str]] = field(repr=False, default_factory=list)
    orphans: dict[int, list[str]] = field(repr=False, default_factory=dict)
    layer_needs: list[list[str]] = field(repr=False, default_factory=list)  # node names per layer
    is_tensor: dict[str, bool] = field(repr=False, default_factory=dict)  # per traced node
    # nodes that modify tensors they read in place, and those tensors' nodes (`_record`)
    mutations: dict[str, list[str]] = field(repr=False, default_factory=dict)

    def layer_names(self) -> list[str]:
        return [layer.name for layer in self.layers]

    def layer(self, name: str) -> Layer:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise PipeplanError(f"no layer named {name!r}; layers are {self.layer_names()}")

    def edges(self) -> list[Edge]:
        """One edge per (producer, consumer layer, tensor), in consumer order."""
        out: list[Edge] = []
        for t in self.tensors.values():
            for c in t.consumers:
                out.append(Edge(src=t.producer, dst=c, bytes=t.bytes, tensor=t.id))
        index = {n: i for i, n in enumerate(self.layer_names())}
        out.sort(key=lambda e: (index[e.dst], -1 if e.src == INPUT_NODE else index[e.src]))
        return out

    def cut_bytes(self) -> list[int]:
        """Bytes of the tensors produced at or before layer i and used after it, i < L-1."""
        index = {n: i for i, n in enumerate(self.layer_names())}
        out = []
        for i in range(len(self.layers) - 1):
            total = 0
            for t in self.tensors.values():
                p = -1 if t.producer == INPUT_NODE else index[t.producer]
                if p <= i < max(index[c] for c in t.consumers):
                    total += t.bytes
            out.append(total)
        return out

    def complete_state_dict(self, partial: dict[str, Any]) -> dict[str, Any]:
        """Add the other names of tied tensors (a stage holds a tied weight under one name)."""
        out = dict(partial)
        for group in self.alias_groups:
            have = [k for k in group if k in out]
            if have:
                for k in group:
                    out.setdefault(k, out[have[0]])
        return out


class StageModule(fx.GraphModule):
    """Some layers of a model as one module: `forward(values: dict) -> dict` (see module doc)."""

    input_keys: list[str]
    output_keys: list[str]
    layer_names: list[str]
    mutated_inputs: list[str]  # the input keys its forward changes in place (`LayerGraph.mutations`)


# ---------------------------------------------------------------- tracing


def _version(t: torch.Tensor) -> int | None:
    try:
        return int(t._version)
    except (RuntimeError, AttributeError):  # tensors without a version counter
        return None


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's data lives (shared by a tensor and its views); None for none."""
    try:
        st = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, meta, ...
        return None
    return st.data_ptr() if st.nbytes() > 0 else None


def _record(traced: Traced, inputs: tuple[torch.Tensor, ...]
            ) -> tuple[dict[str, bool], dict[str, int], dict[str, list[str]]]:
    """Run the graph once; per node: is its value a tensor, and its bytes; and the nodes that
    modify a tensor they read in place (its version counter moves), with the nodes they
    modify: `nn.ReLU(inplace=True)`, `x += y`, `x.add_(...)`, a block that changes its input,
    and a change through a view, which modifies every live tensor on the same storage."""
    is_tensor: dict[str, bool] = {}
    nbytes: dict[str, int] = {}
    mutates: dict[str, list[str]] = {}

    class Rec(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            before = [(a.name, t, _version(t)) for a in n.all_input_nodes
                      if isinstance(t := self.env.get(a), torch.Tensor)]
            value = super().run_node(n)
            changed = [name for name, t, v in before if v is not None and _version(t) != v]
            if changed:
                # a change made through a view (`x.view(-1).add_(1)`, `x[:, 0].zero_()`)
                # changes its base and every other view of it: those nodes too
                hit = {_storage(t) for name, t, v in before if name in changed} - {None}
                aliases = [a for a, t in self.env.items() if a.name not in changed and a is not n
                           and isinstance(t, torch.Tensor) and _storage(t) in hit]
                mutates[n.name] = changed + sorted(a.name for a in aliases)
            is_tensor[n.name] = isinstance(value, torch.Tensor)
            leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
            nbytes[n.name] = sum(v.numel() * v.element_size() for v in leaves)
            return value

    with torch.no_grad():
        Rec(traced.gm).run(*inputs)
    return is_tensor, nbytes, mutates


def _closure(lg_gm: fx.GraphModule, kind: dict[str, str], owner: dict[str, int],
             layer_idx: set[int]) -> tuple[list[fx.Node], list[str]]:
    """Nodes a stage runs (its own plus recomputed ones) in graph order, and its input keys."""
    nodes_by_name = {n.name: n for n in lg_gm.graph.nodes}
    chosen: set[str] = {n for n, i in owner.items() if i in layer_idx}
    needed_inputs: set[str] = set()
    stack = list(chosen)
    while stack:
        name = stack.pop()
        for a in nodes_by_name[name].all_input_nodes:
            if a.name in chosen:
                continue
            k = kind[a.name]
            if k == "input":
                needed_inputs.add(a.name)
            elif k in ("attr", "free", "recompute"):
                chosen.add(a.name)
                stack.append(a.name)
            else:
                needed_inputs.add(a.name)
    order = [n for n in lg_gm.graph.nodes if n.name in chosen]
    position = {name: i for i, name in enumerate(nodes_by_name)}
    return order, sorted(needed_inputs, key=position.__getitem__)


def _tensor_id(node: fx.Node, placeholders: list[str]) -> str:
    return input_key(placeholders.index(node.name)) if node.op == "placeholder" else node.name


def _param_targets(root: torch.nn.Module, nodes: list[fx.Node]) -> dict[str, torch.Tensor]:
    """State-dict-like key -> tensor for every parameter/buffer the nodes reference."""
    out: dict[str, torch.Tensor] = {}
    for n in nodes:
        if n.op == "get_attr":
            obj = _get(root, n.target)
            if isinstance(obj, torch.Tensor):
                out[n.target] = obj
        elif n.op == "call_module":
            m = _get(root, n.target)
            for k, v in m.state_dict(keep_vars=True).items():
                out[f"{n.target}.{k}"] = v
    return out


def _get(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def trace(model: torch.nn.Module, example_inputs: tuple[torch.Tensor, ...] | list[torch.Tensor],
          granularity: str = "blocks", tensor_kinds: dict[str, bool] | None = None,
          mutations: dict[str, list[str]] | None = None, method: str | None = None) -> LayerGraph:
    """Trace `model(*example_inputs)` into layers at `granularity` (blocks | modules | depth:N |
    split:A,B). To learn which values are tensors, and their bytes, the traced graph runs once
    under no_grad (the model's buffers are left as they were; hooks and prints do fire). Given
    `tensor_kinds` (`LayerGraph.is_tensor` of an earlier trace of the same model and
    granularity, e.g. made by the launcher) that run is skipped — no user code runs, and edge
    bytes are 0 — unless the graph's nodes differ from it; `mutations` (`LayerGraph.mutations`
    of that trace) then says which nodes modify a tensor in place, and `method` (its
    `LayerGraph.method`) how it traced, so this trace takes the same way without running the
    checks that chose it.

    A tensor modified in place keeps in one layer the node that modifies it, the node that
    made it and every node that reads it (`segment.merge_mutated`): autograd forbids the
    modification on a received tensor (a stage's input is a leaf), and a stage that read the
    tensor before it changed would otherwise see it changed, or the other way round.
    Lazy modules must be initialised first (`profiler.loader.materialize_lazy`)."""
    from torch.nn.parameter import is_lazy

    lazy = [k for k, t in (*model.named_parameters(), *model.named_buffers()) if is_lazy(t)]
    if lazy:
        raise PipeplanError(
            f"the model has lazy modules not initialised yet ({', '.join(lazy[:3])}"
            f"{', ...' if len(lazy) > 3 else ''}): run one forward before tracing it "
            "(profiler.loader.build_checked(model_file, batch_size) does)")
    # the forwards run to trace leave the model as they found it: buffers, Python attributes
    # (a call counter, a list), its own generators (under torchrun every rank traces, and
    # state one call ahead trained differently from one process)
    from profiler.module_state import BlockState

    state = BlockState(model, frozen=False)  # (a frozen backbone is not copied)
    saved, rng = state.capture(every=True), global_rng_states()  # (Python's and numpy's too)
    try:
        return _trace(model, tuple(example_inputs), granularity, tensor_kinds, mutations, method)
    finally:
        state.restore(saved)
        set_global_rng_states(rng)


def _child_index(spec: pytree.TreeSpec, key: object) -> int | None:
    """Which child of a tuple, list or dict node `spec[key]` selects (None: another node type)."""
    if spec.type in (tuple, list) or pytree.is_namedtuple_class(spec.type):
        n = spec.num_children
        if not isinstance(key, int) or not -n <= key < n:
            return None
        return key % n  # (a negative index counts from the end)
    if spec.type is dict and isinstance(spec.context, list) and key in spec.context:
        return spec.context.index(key)
    return None


def select_unflattened(gm: fx.GraphModule) -> int:
    """Replace each item taken out of a `tree_unflatten` (through `getitem`s) that is one of its
    leaves by that leaf, and drop what is then unused. torch.export's kept block calls pack a
    block's arguments and keywords with `tree_unflatten([hidden, mask, ...], spec)` and take
    them out one by one: a layer reading only the keywords then depended on the whole pack, so
    every cut sent the hidden state twice (an outside review, on every exported Hugging Face
    decoder). Returns how many items were replaced."""
    def spec_of(arg: object) -> pytree.TreeSpec | None:
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            arg = _get(gm, str(arg.target))
        return arg if isinstance(arg, pytree.TreeSpec) else None

    replaced = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not operator.getitem:
            continue
        keys, src = [], n
        while src.op == "call_function" and src.target is operator.getitem and isinstance(src.args[0], fx.Node):
            keys.append(src.args[1])
            src = src.args[0]
        if src.op != "call_function" or src.target is not pytree.tree_unflatten or len(src.args) != 2:
            continue
        leaves, spec = src.args[0], spec_of(src.args[1])
        if spec is None or not isinstance(leaves, list | tuple) or len(leaves) != spec.num_leaves:
            continue
        offset = 0
        for key in reversed(keys):
            i = None if spec.is_leaf() else _child_index(spec, key)
            if i is None:
                break
            offset += sum(spec.child(j).num_leaves for j in range(i))
            spec = spec.child(i)
        else:
            if spec.is_leaf():
                value = leaves[offset]
                for user in list(n.users):
                    user.args = fx.node.map_arg(user.args, lambda a, n=n, v=value: v if a is n else a)
                    user.kwargs = fx.node.map_arg(user.kwargs, lambda a, n=n, v=value: v if a is n else a)
                replaced += 1
    if replaced:
        packing = (operator.getitem, pytree.tree_unflatten)
        for n in reversed(list(gm.graph.nodes)):
            if n.op == "call_function" and n.target in packing and not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
    return replaced


def _trace(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], granularity: str,
           tensor_kinds: dict[str, bool] | None = None,
           mutations: dict[str, list[str]] | None = None, method: str | None = None) -> LayerGraph:
    mode, _ = seg.parse_granularity(granularity)  # a bad value fails before tracing
    leaves = seg.leaf_modules(model, granularity)
    keep = seg.natural_blocks(model)[0] if mode in ("blocks", "split") else None
    # a rank tracing from its launcher's record (`tensor_kinds`) runs no user code: the
    # launcher checked the graph
    traced = capture(model, inputs, leaves, keep, check=tensor_kinds is None, method=method)
    gm = traced.gm
    select_unflattened(gm)  # on the launcher's trace and every rank's alike: the same node names
    root: torch.nn.Module = model if traced.method == "fx" else gm
    if traced.out_spec is not None:
        setattr(gm, OUT_SPEC_ATTR, traced.out_spec)
    # the buffers the recorded run changes in place (running statistics); None: not recorded
    changed: set[int] | None = None
    if tensor_kinds is not None and set(tensor_kinds) == {n.name for n in gm.graph.nodes}:
        is_tensor, nbytes, mutates = dict(tensor_kinds), {}, dict(mutations or {})
    else:
        # (by value too: BatchNorm's kernel updates its running statistics without moving
        # their version counter)
        before = {id(b): (b, _version(b), b.detach().clone()) for b in root.buffers() if not b.is_meta}
        is_tensor, nbytes, mutates = _record(traced, inputs)
        changed = {k for k, (b, v, old) in before.items() if _version(b) != v or not torch.equal(b, old)}
    kind = seg.classify(gm, is_tensor)
    keys, labels = seg.group_keys(gm, model, traced.paths, granularity)
    segs, owner = seg.segment(gm, keys, kind, labels)
    segs, owner = seg.merge_untransferable(segs, owner, gm, kind, is_tensor)
    segs, owner = seg.merge_mutated(segs, owner, gm, mutates)
    segs, owner = seg.merge_at_split_points(segs, owner, seg.split_points(granularity))
    named = seg.name_segments(segs, model)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    owner[output_node.name] = len(segs) - 1
    layers = [Layer(name, k, s.nodes, s.paths) for (name, k), s in zip(named, segs, strict=True)]
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]

    # tensors crossing layer boundaries: the inputs of every single-layer stage
    tensors: dict[str, TensorInfo] = {}
    per_layer_params: list[dict[str, torch.Tensor]] = []
    layer_needs: list[list[str]] = []
    by_name = {n.name: n for n in gm.graph.nodes}
    for i, layer in enumerate(layers):
        nodes, needed = _closure(gm, kind, owner, {i})
        layer_needs.append(needed)
        per_layer_params.append(_param_targets(root, nodes))
        for name in needed:
            node = by_name[name]
            tid = _tensor_id(node, placeholders)
            producer = INPUT_NODE if node.op == "placeholder" else layers[owner[name]].name
            info = tensors.setdefault(tid, TensorInfo(tid, producer, [], nbytes.get(name, 0)))
            info.consumers.append(layer.name)

    g = nx.DiGraph()
    for i, layer in enumerate(layers):
        g.add_node(layer.name, index=i, kind=layer.kind)
    for t in tensors.values():
        for c in t.consumers:
            if t.producer == INPUT_NODE:
                g.nodes[c].setdefault("inputs", {})[t.id] = t.bytes
                continue
            if not g.has_edge(t.producer, c):
                g.add_edge(t.producer, c, bytes=0, tensors={})
            g.edges[t.producer, c]["tensors"][t.id] = t.bytes
            g.edges[t.producer, c]["bytes"] += t.bytes

    # tied parameters: one tensor referenced by several layers
    by_id: dict[int, list[tuple[str, str]]] = {}
    for layer, params in zip(layers, per_layer_params, strict=True):
        for key, tensor in params.items():
            by_id.setdefault(id(tensor), []).append((layer.name, key))
    shared = []
    tensor_of = {id(t): t for params in per_layer_params for t in params.values()}
    shared_buffers: dict[tuple[str, ...], list[str]] = {}
    for tid, refs in by_id.items():
        layer_set = list(dict.fromkeys(lname for lname, _ in refs))
        if len(layer_set) > 1:
            t = tensor_of[tid]
            is_param = isinstance(t, torch.nn.Parameter)
            shared.append(SharedParameter(list(dict.fromkeys(k for _, k in refs)), layer_set,
                                          t.numel() * t.element_size(),
                                          is_param and not t.requires_grad, not is_param))
            # a buffer only read (a constant, a positional table) is the same in every stage
            if not isinstance(tensor_of[tid], torch.nn.Parameter) and (changed is None or tid in changed):
                shared_buffers.setdefault(tuple(layer_set), []).append(refs[0][1])
    for layer_set, keys in shared_buffers.items():
        warnings.warn(
            f"buffers {', '.join(keys)} belong to a module that layers {', '.join(layer_set)} all "
            "call: where those layers run in different stages, each stage updates its own copy "
            "(running statistics then differ from one process's); keep them in one stage (plan "
            "--method manual --split) or call the module once", TracingWarning, stacklevel=3)

    # names of tied tensors (for complete_state_dict) and unreferenced state (orphans)
    state = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for k, v in state.items():
        groups.setdefault(id(v), []).append(k)
    alias_groups = [ks for ks in groups.values() if len(ks) > 1]
    held = {k for params in per_layer_params for k in params}
    held_ids = {id(state[k]) for k in held if k in state}
    orphans: dict[int, list[str]] = {}
    for k, v in state.items():
        if k in held or id(v) in held_ids:
            continue
        best, best_len = len(layers) - 1, -1
        for i, layer in enumerate(layers):
            for p in layer.module_paths:
                if p and (k.startswith(p + ".")) and len(p) > best_len:
                    best, best_len = i, len(p)
        orphans.setdefault(best, []).append(k)

    return LayerGraph(
        layers=layers, graph=g, tensors=tensors, shared_parameters=shared,
        method=traced.method, granularity=granularity,
        num_inputs=len(inputs), gm=gm, root=root, kind=kind, owner=owner,
        alias_groups=alias_groups, orphans=orphans, layer_needs=layer_needs, is_tensor=is_tensor,
        mutations=mutates,
    )


# ---------------------------------------------------------------- stages


def build_stage(layer_graph: LayerGraph, layer_names: list[str]) -> StageModule:
    """An nn.Module computing the given layers (see the module docstring)."""
    lg = layer_graph
    index = {name: i for i, name in enumerate(lg.layer_names())}
    unknown = [n for n in layer_names if n not in index]
    if unknown or not layer_names:
        raise PipeplanError(
            f"build_stage: unknown layer(s) {unknown or layer_names}; the model's layers are "
            f"{lg.layer_names()} (was the plan made for this model and granularity?)"
        )
    idx = {index[n] for n in layer_names}
    gm = lg.gm
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    nodes, needed = _closure(gm, lg.kind, lg.owner, idx)
    nodes = [n for n in nodes if n.op != "output"]
    by_name = {n.name: n for n in gm.graph.nodes}
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    owns_output = lg.owner[output_node.name] in idx

    # values this stage produces that a layer outside it needs
    outside = [i for i in range(len(lg.layers)) if i not in idx]
    wanted: set[str] = set()
    for i in outside:
        wanted.update(lg.layer_needs[i])
    if not owns_output:
        for a in output_node.all_input_nodes:
            if lg.kind[a.name] not in ("input", "attr", "free", "recompute"):
                wanted.add(a.name)
    produced = [n.name for n in nodes if lg.owner.get(n.name) in idx and n.name in wanted]

    g = fx.Graph()
    values = g.placeholder("values")
    env: dict[fx.Node, fx.Node] = {}
    input_keys = [_tensor_id(by_name[n], placeholders) for n in needed]
    for name, key in zip(needed, input_keys, strict=True):
        env[by_name[name]] = g.call_function(operator.getitem, (values, key))
    for node in nodes:
        env[node] = g.node_copy(node, lambda a: env[a])
    result: dict[str, Any] = {}
    for name in produced:
        result[name] = env[by_name[name]]
    output_keys = list(produced)
    if owns_output:
        out_arg = fx.map_arg(output_node.args[0], lambda a: env[a])
        if getattr(lg.gm, OUT_SPEC_ATTR, None) is not None:
            spec = g.get_attr(OUT_SPEC_ATTR)
            flat = list(out_arg) if isinstance(out_arg, tuple | list) else [out_arg]
            out_arg = g.call_function(pytree.tree_unflatten, (flat, spec))
        result[OUTPUT_KEY] = out_arg
        output_keys.append(OUTPUT_KEY)
    g.output(result)

    stage = StageModule(lg.root, g, "StageModule")
    _fix_buffers(lg.root, stage, nodes)
    for i in sorted(idx):
        for key in lg.orphans.get(i, []):
            _copy_state(lg.root, stage, key)
    stage.input_keys = input_keys
    stage.output_keys = output_keys
    changed = {m for n in nodes for m in lg.mutations.get(n.name, ())}
    stage.mutated_inputs = [key for name, key in zip(needed, input_keys, strict=True) if name in changed]
    stage.layer_names = [n for n in lg.layer_names() if n in set(layer_names)]
    return stage


def _fix_buffers(root: torch.nn.Module, stage: torch.nn.Module, nodes: list[fx.Node]) -> None:
    """GraphModule registers copied buffers as persistent; keep the original persistence."""
    for n in nodes:
        if n.op != "get_attr":
            continue
        prefix, _, field_name = str(n.target).rpartition(".")
        try:  # a buffer of the model itself (no prefix) as well as one of a submodule
            src, dst = (_get(root, prefix), _get(stage, prefix)) if prefix else (root, stage)
        except AttributeError:
            continue
        if src is not dst and field_name in getattr(src, "_non_persistent_buffers_set", ()):
            dst._non_persistent_buffers_set.add(field_name)


def _copy_state(root: torch.nn.Module, stage: torch.nn.Module, key: str) -> None:
    """Attach a parameter/buffer no node references (kept so state dicts stay complete)."""
    prefix, _, field_name = key.rpartition(".")
    try:
        src = _get(root, prefix) if prefix else root
        value = getattr(src, field_name)
    except AttributeError:
        return
    dst: torch.nn.Module = stage
    for part in prefix.split(".") if prefix else []:
        nxt = getattr(dst, part, None)
        if nxt is None:
            nxt = torch.nn.Module()
            setattr(dst, part, nxt)
        dst = nxt
    if isinstance(value, torch.nn.Parameter):
        dst.register_parameter(field_name, value)
    elif isinstance(value, torch.Tensor) and field_name not in dst._buffers:
        dst.register_buffer(field_name, value,
                            persistent=field_name not in getattr(src, "_non_persistent_buffers_set", ()))
