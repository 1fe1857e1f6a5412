"""The state a module's forward may read and change besides its inputs and parameters, kept and
put back: recomputation runs a block's forward once more on the state its first forward found
(`runtime.recompute`), and a forward run only to trace the model must leave the model as it
found it (`profiler.graph.trace_model`, under torchrun on every rank).

What is kept, per module:
- every attribute by reference (a forward that rebinds one, `self.scale = self.scale * 1.1`,
  buffers included: a registered buffer rebound lives in `_buffers`), so putting back rebinds
  the object the forward found;
- tensors (buffers, tensor attributes and frozen parameters — `requires_grad=False`, such as
  MoCo's momentum encoder, which a forward may update under no_grad —, not trained parameters)
  by copy where a forward changes them in place: those of at most SMALL_TENSOR_BYTES (step
  counters, running statistics) at every capture; a larger one at the captures after a forward
  was seen to change it, and at the first capture that sees it (`BlockState.learn`). A change
  through `.data` moves no version: the first forward's is found by comparing values, a later
  one's (over the first WATCHED_CAPTURES) by a fingerprint, and from then on such a tensor is
  copied at every capture and always put back;
- numbers, strings and the like by value; lists, dicts, sets and deques of such values (and of
  tensors) by a deep copy, put back into the same container object (`self.hist.append(x)`);
  the tensors in them by reference (`_copy_contents`: a list of the module's own parameters must
  hold those parameters after it), and the values of those that need no gradient by a copy at
  every capture, written back where a forward moved their version (a view of a large buffer
  written back would move the buffer's);
- generators of its own (`torch.Generator`, `random.Random`, numpy's `Generator` and
  `RandomState`) by their state.
Anything else (an attribute holding another object) is kept by reference only.
"""

from __future__ import annotations

import copy
import random
from collections import deque
from typing import Any

import torch
from torch import nn

from planner.errors import PipeplanError

_ATOMS = (int, float, bool, complex, str, bytes, type(None), torch.Tensor)
_MODULE_KEYS = frozenset(vars(nn.Module()))  # nn.Module's own: parameters, hooks, `training`
CONTAINER_ITEMS = 100_000  # a list, dict or set with more values is kept by reference only
SMALL_TENSOR_BYTES = 1 << 16  # a tensor this small is copied at every capture
WATCHED_CAPTURES = 64  # captures of a block whose larger tensors are fingerprinted (`fingerprint`)
# a graph module's own bookkeeping (torch.fx's, and a stage's keys from `profiler.graph`), which
# no forward changes: copied at every capture it was most of a recomputed block's overhead
_GRAPH_KEYS = _MODULE_KEYS | frozenset(
    vars(torch.fx.GraphModule(nn.Module(), torch.fx.Graph()))) | frozenset(
    {"input_keys", "output_keys", "mutated_inputs", "layer_names"})


def _own_keys(m: nn.Module) -> frozenset[str]:
    """The attributes of `m` that are the framework's, not state a forward keeps."""
    return _GRAPH_KEYS if isinstance(m, torch.fx.GraphModule) else _MODULE_KEYS


def _atom(v: object) -> bool:
    return isinstance(v, _ATOMS) or (isinstance(v, tuple) and all(isinstance(x, _ATOMS) for x in v))


def _plain(v: object, left: list[int], depth: int = 0) -> bool:
    """A container of numbers, strings, tensors and such containers (at most `left[0]` values
    over all of them)."""
    if isinstance(v, (list, tuple, set, frozenset, deque)):
        items: Any = v
    elif isinstance(v, dict):
        items = [*v.keys(), *v.values()]
    else:
        return isinstance(v, _ATOMS)
    left[0] -= len(items)
    if left[0] < 0 or depth > 8:
        return False
    return all(_plain(x, left, depth + 1) for x in items)


def _contained_tensors(v: object) -> list[torch.Tensor]:
    """The tensors in a plain container (`_plain`), at any depth."""
    found: list[torch.Tensor] = []
    stack = [v]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset, deque)):
            stack.extend(x)
    return found


def _copy_contents(v: object, tensors: list[torch.Tensor]) -> object:
    """A copy of a plain container (`_plain`) and of the containers in it that keeps every tensor
    by reference: a list may hold the module's own parameters and buffers (`RNNBase._flat_weights`,
    a user's `self.experts = [self.w0, self.w1]`), which the optimizer, the checkpoint and the
    gradient all-reduce hold too, so what is put back must be those objects, not copies (a copy
    left the forward reading weights the optimizer never moved); deepcopy also refuses the tensors
    of an autograd graph (a U-Net's stack of features). A tensor's values a forward changes in
    place are kept by `BlockState` like a buffer's. `tensors`: `_contained_tensors(v)`."""
    memo: dict[int, object] = {id(t): t for t in tensors}
    return copy.deepcopy(v, memo)


def _generator_state(v: object) -> object | None:
    if isinstance(v, torch.Generator):
        return v.get_state()
    if isinstance(v, random.Random):
        return v.getstate()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is torch's dependency here
        return None
    if isinstance(v, np.random.Generator):
        return copy.deepcopy(v.bit_generator.state)
    if isinstance(v, np.random.RandomState):
        return v.get_state()
    return None


def _set_generator_state(v: object, state: object) -> None:
    if isinstance(v, torch.Generator):
        v.set_state(state)  # type: ignore[arg-type]
    elif isinstance(v, random.Random):
        v.setstate(state)  # type: ignore[arg-type]
    elif hasattr(v, "bit_generator"):
        v.bit_generator.state = copy.deepcopy(state)  # type: ignore[attr-defined]
    else:
        v.set_state(state)  # type: ignore[attr-defined]


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SAMPLED_ELEMENTS = 4096  # a sampled fingerprint reads about this many elements


def fingerprint(t: torch.Tensor, sample: bool = False) -> tuple[float, ...]:
    """Numbers that move when a tensor's values do, without a copy of it: the sum and the 2-norm
    in float64 (integers and booleans: the sum; types torch cannot sum so, float8: the sum of
    their bits). NaN compares equal to NaN (`same`). `sample`: of every n-th element only, about
    SAMPLED_ELEMENTS of a contiguous tensor (an update that moves every element, a momentum
    encoder's, a data-dependent initialisation, is seen at a fraction of the cost). () where
    nothing can be read (sparse, meta, quantized)."""
    x = t.detach()
    if x.layout != torch.strided or x.is_meta or x.is_quantized:
        return ()
    if x.is_complex():
        x = torch.view_as_real(x)
    if sample and x.is_contiguous() and x.numel() > 2 * SAMPLED_ELEMENTS:
        x = x.view(-1)[:: x.numel() // SAMPLED_ELEMENTS]
    try:
        if x.is_floating_point():
            return (float(torch.sum(x, dtype=torch.float64)),
                    float(torch.linalg.vector_norm(x, dtype=torch.float64)))
        return (float(torch.sum(x, dtype=torch.int64)),)
    except (RuntimeError, TypeError):  # float8 and the like: their bits
        bits = _SAME_SIZE_INT.get(x.element_size())
        if bits is None:
            return ()
        try:
            return (float(torch.sum(x.view(bits), dtype=torch.int64)),)
        except (RuntimeError, TypeError):
            return ()


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (a NaN in a buffer is not a change)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not (a.is_floating_point() or a.is_complex()):
        return False
    try:
        return bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
    except (RuntimeError, TypeError):  # (float8: no comparisons)
        return False


def same(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x == y or (x != x and y != y) for x, y in zip(a, b, strict=True))


def _put_back(obj: Any, saved: Any) -> None:
    """The contents of container `obj` as `saved` (a deep copy taken from it)."""
    if isinstance(obj, (list, deque)):
        obj.clear()
        obj.extend(saved)
    elif isinstance(obj, (dict, set)):
        obj.clear()
        obj.update(saved)


class Snapshot:
    """A block's state as one capture found it."""

    def __init__(self) -> None:
        self.refs: list[dict[str, object]] = []  # per module: every attribute, by reference
        self.buffers: list[dict[str, object]] = []  # per module: its `_buffers`, by reference
        self.contents: list[dict[str, object]] = []  # per module: containers' deep copies
        self.generators: list[dict[str, object]] = []  # per module: generators' states
        self.tensors: dict[int, torch.Tensor] = {}  # the tensors found, by id
        self.versions: dict[int, int] = {}
        self.copies: dict[int, torch.Tensor] = {}
        self.prints: dict[int, tuple[float, ...]] = {}  # larger tensors not copied (`fingerprint`)
        self.params: list[dict[str, object]] = []  # per module: its `_parameters`, by reference


class BlockState:
    """The state of one block's modules (the module's docstring). A large tensor first changed
    in place by a later forward has no copy in the snapshots taken before it was seen to
    change: putting one of those back stops with a clear error (`restore`) rather than leave
    the moved tensor."""

    def __init__(self, block: nn.Module, frozen: bool = True) -> None:
        """`frozen`: frozen parameters are state (a recomputed block's); False for the whole
        model around a trace (a first capture copies every tensor it keeps: a frozen backbone
        would be copied whole, and a trace ran without putting them back before)."""
        self.modules = list(block.modules())
        self.params = {id(p) for p in block.parameters() if p.requires_grad or not frozen}
        self.names: dict[int, str] = {}  # for the error of `restore`
        self.changed: set[int] | None = None  # ids of tensors a forward changed; None: none ran yet
        self.seen: set[int] = set()  # ids of tensors some capture copied or a forward was watched on
        self.small: set[int] = set()
        # ids of tensors found in containers: copied at every capture (as the container's deep
        # copy did) and put back where their version moved, as a large buffer is
        self.contained: set[int] = set()
        # ids of tensors a forward changed without moving their version (through `.data`):
        # copied at every capture and always put back, as small ones
        self.unversioned: set[int] = set()
        self.captures = 0
        # ids of frozen parameters: copied by a capture of everything (`every`) only where a
        # forward was seen to change them (a frozen backbone, LoRA's, is most of the model)
        self.frozen: set[int] = set()
        self.owners: dict[int, list[tuple[nn.Module, str]]] = {}  # a frozen parameter's holders

    def _tensors(self, plain: list[list[tuple[str, list[torch.Tensor]]]]) -> dict[int, torch.Tensor]:
        """Buffers, tensor attributes and the tensors in plain containers (`plain`: per module,
        each container attribute's name and tensors, as `capture` found them) that need no
        gradient (parameters, another module's included, and an autograd graph's tensors are
        kept by reference only: only the optimizer changes the first in place)."""
        found: dict[int, torch.Tensor] = {}
        for m, containers in zip(self.modules, plain, strict=True):
            named: list[tuple[str, object, bool]] = [(k, t, False) for k, t in m._buffers.items()]
            frozen = [(k, p) for k, p in m._parameters.items() if p is not None and not p.requires_grad]
            named.extend((k, p, False) for k, p in frozen)
            self.frozen.update(id(p) for _, p in frozen)
            for k, p in frozen:
                if (m, k) not in self.owners.setdefault(id(p), []):
                    self.owners[id(p)].append((m, k))
            own = _own_keys(m)
            for name, v in vars(m).items():
                if name not in own and isinstance(v, torch.Tensor):
                    named.append((name, v, False))
            for name, tensors in containers:
                named.extend((f"{name}[...]", t, True) for t in tensors if not t.requires_grad)
            for name, t, contained in named:
                if isinstance(t, torch.Tensor) and id(t) not in self.params and id(t) not in found:
                    found[id(t)] = t
                    self.names.setdefault(id(t), f"{type(m).__name__}.{name}")
                    # a container's: copied at every capture, as the container's deep copy did
                    # (it may come and go with the container's contents between forwards); not
                    # written back unless it moved: a view of a large buffer (rotary tables kept
                    # as `{"cos": self.table[0]}`) would move the buffer's version with it
                    if contained:
                        self.contained.add(id(t))
                    if t.numel() * t.element_size() <= SMALL_TENSOR_BYTES:
                        self.small.add(id(t))
        return found

    def capture(self, every: bool = False) -> Snapshot:
        snap = Snapshot()
        plain: list[list[tuple[str, list[torch.Tensor]]]] = []  # per module, its containers' tensors
        for m in self.modules:
            refs, contents, gens = {}, {}, {}
            plain.append([])
            own = _own_keys(m)
            for k, v in vars(m).items():
                if k in own:
                    continue
                refs[k] = v
                if _atom(v):
                    continue
                if (state := _generator_state(v)) is not None:
                    gens[k] = state
                elif _plain(v, [CONTAINER_ITEMS]):
                    tensors = _contained_tensors(v)
                    plain[-1].append((k, tensors))
                    if not isinstance(v, (tuple, frozenset)):
                        contents[k] = _copy_contents(v, tensors)
            snap.refs.append(refs)
            snap.buffers.append(dict(m._buffers))
            snap.params.append(dict(m._parameters))
            snap.contents.append(contents)
            snap.generators.append(gens)
        snap.tensors = self._tensors(plain)
        snap.versions = {k: t._version for k, t in snap.tensors.items()}
        snap.copies = {k: self._copy(k, t) for k, t in snap.tensors.items()
                       if (every and k not in self.frozen) or self.changed is None or k not in self.seen
                       or k in self.changed or k in self.small or k in self.contained}
        self.seen |= snap.copies.keys()
        if not every:  # (a recomputation's own captures do not count)
            self.captures += 1
        if self.captures <= WATCHED_CAPTURES and not every:
            snap.prints = {k: fingerprint(t, sample=True) for k, t in snap.tensors.items() if k not in snap.copies}
        return snap

    def _copy(self, k: int, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t`; of a larger frozen parameter not seen to change, in host memory (a
        frozen backbone's block on a GPU: the first capture copies it, once)."""
        if k in self.frozen and k not in self.small and k not in (self.changed or ()) and t.device.type != "cpu":
            return t.detach().to("cpu", copy=True)
        return t.detach().clone()

    def learn(self, snap: Snapshot) -> None:
        """After the forward `snap` was taken for: note the tensors it changed, and drop the
        copies nothing will need."""
        moved = {k for k, t in snap.tensors.items() if t._version != snap.versions[k]}
        # changed through `.data`: the first forward's seen against its copies, a later one's
        # by the fingerprints (its own snapshot, and older ones, lack a copy: `restore` refuses)
        hidden = {k for k, t in snap.tensors.items() if k not in moved and k not in self.small and (
            (k in snap.copies and self.changed is None
             and not _equal(t.detach().to(snap.copies[k].device), snap.copies[k]))
            or (k in snap.prints and not same(fingerprint(t, sample=True), snap.prints[k])))}
        self.unversioned |= hidden
        moved |= hidden
        self.changed = moved | (self.changed or set()) | self.small  # small ones: always copied
        keep = self.changed | self.contained | self.unversioned
        self.seen |= snap.tensors.keys()
        for key in [k for k in snap.copies if k not in keep]:
            del snap.copies[key]

    def restore(self, snap: Snapshot, stand_in: bool = False) -> None:
        """Put the block's state back as `snap` found it. `stand_in` (a recomputation's): a
        frozen parameter is held, until the next restore, by a stand-in with the values `snap`
        copied, not written back in place: the recomputed forward saves it for the backward
        (an EMA teacher's Linear saves its weight), and the restore after the recomputation
        puts the parameter itself back as it is now, which would have changed what was saved.
        Without `stand_in` frozen parameters are put back as the objects `snap` found."""
        lost = [t for k, t in snap.tensors.items() if k not in snap.copies
                and (t._version != snap.versions[k]
                     or (k in self.unversioned and (stand_in or k not in self.frozen)))]
        if lost:
            t = lost[0]
            raise PipeplanError(
                f"recomputation: a forward (this microbatch's or a later one's) changed "
                f"{self.names.get(id(t), 'a tensor')} ({t.numel() * t.element_size()} "
                "bytes) in place for the first time (under no_grad or through .data), after this "
                "microbatch's forward had read it; "
                "its recomputation cannot run on the state that forward found. Plan this stage "
                "without recomputation (--no-recompute, or --recompute with 0 for it)")
        for m, refs, bufs, params, contents, gens in zip(self.modules, snap.refs, snap.buffers, snap.params,
                                                         snap.contents, snap.generators, strict=True):
            m.__dict__.update(refs)
            m._buffers.update(bufs)  # type: ignore[arg-type]
            m._parameters.update(params)  # type: ignore[arg-type]
            for k, saved in contents.items():
                _put_back(refs[k], _copy_contents(saved, _contained_tensors(saved)))
            for k, state in gens.items():
                _set_generator_state(refs[k], state)
        with torch.no_grad():
            for k, c in snap.copies.items():
                t = snap.tensors[k]
                if stand_in and k in self.frozen:
                    held = nn.Parameter(c.to(t.device, copy=True), requires_grad=False)
                    for m, name in self.owners.get(k, ()):
                        m._parameters[name] = held
                    continue
                # a large one only where its version moved (a copy back moves it too, and the
                # snapshots before would take that for a change); a small one always (a change
                # through `.data` moves no version), unless a container's (`_tensors`)
                if ((k in self.small or k in self.unversioned) and k not in self.contained) \
                        or t._version != snap.versions[k]:
                    t.copy_(c)
