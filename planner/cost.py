"""The cost model of ARCHITECTURE.md as pure functions: stage compute, traffic between stages
(skip tensors included), transfer and all-reduce time, memory per device, the lower bound.

Everything a partitioner, the simulator or the CP-SAT model needs is computed here, once, so
every package predicts the same numbers. Microbatch scaling: with `b` the microbatch size and
`B0` the profile's batch size, `scale = b / B0`; layer times and per-sample bytes (activations,
outputs, edges) scale linearly with it, parameter bytes do not.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from planner.errors import PipeplanError
from planner.formats import GB, INPUT_NODE, Cluster, Device, Profile, crossing_bytes
from planner.partition import Candidate, StageChoice

if TYPE_CHECKING:
    from planner.actions import Action

LinkKind = Literal["intra", "inter"]
OPTIMIZER_EXTRA_COPIES = {"sgd": 0, "momentum": 1, "adam": 2}


# ---------------------------------------------------------------- per-layer tables


@dataclass(frozen=True)
class Tensor:
    """A value produced by layer `producer` (-1: a model input) and used by `consumers`."""

    producer: int
    consumers: tuple[int, ...]  # sorted layer indices
    nbytes: int  # at the profile's batch size


@dataclass(frozen=True)
class SharedTensor:
    """A tensor held by several layers (the profile's `shared_parameters`): its first holder,
    the others, its bytes and kind ("trained", "frozen" or "buffer")."""

    first: int
    others: tuple[int, ...]
    nbytes: int
    kind: str


def _held_back(tensors: tuple[SharedTensor, ...], kinds: tuple[str, ...], start: int, stop: int) -> int:
    """Bytes of the shared tensors of `kinds` that layers start..stop-1 hold but that the
    prefix sums count at a first holder outside them."""
    return sum(t.nbytes for t in tensors if t.kind in kinds and not start <= t.first < stop
               and any(start <= i < stop for i in t.others))


@dataclass(frozen=True)
class LayerTable:
    """Prefix sums over the profile's layers (index i = sum of layers 0..i-1) and its tensors,
    so a stage's totals are O(1). Values are at the profile's batch size and speed 1."""

    batch_size: int
    names: tuple[str, ...]
    fwd_prefix_ms: tuple[float, ...]
    bwd_prefix_ms: tuple[float, ...]
    param_prefix_bytes: tuple[int, ...]
    activation_prefix_bytes: tuple[int, ...]
    tensors: tuple[Tensor, ...]
    # zero bubble: the weight-gradient part (W) of bwd; None: see `default_bwd_weight_ms`
    bwd_weight_prefix_ms: tuple[float, ...] | None = None
    # zero bubble: gradients a split B keeps for W (`LayerProfile.weight_grad_bytes`, 0 if
    # absent), and per layer the part that is its outputs' gradients
    weight_grad_prefix_bytes: tuple[int, ...] | None = None
    weight_grad_output_bytes: tuple[int, ...] = ()
    # recomputation: per layer, the part of its activations that is its own inputs
    saved_input_bytes: tuple[int, ...] = ()
    tp: tuple[TPTable, ...] = ()
    loss_activation_bytes: int = 0  # the loss's saved bytes, inside the last layer's activations
    loss_workspace_bytes: int = 0  # what the loss's backward allocates beyond them (`loss_workspace_bytes`)
    # of the parameters, those without gradients (`LayerProfile.frozen_param_bytes`); None: none
    frozen_prefix_bytes: tuple[int, ...] | None = None
    # of the model state, the buffers (`LayerProfile.buffer_bytes`); None: none. They are
    # counted in `param_prefix_bytes` and `frozen_prefix_bytes` as well: a device holds them
    # once, like a frozen parameter (no gradient, optimizer state or all-reduce)
    buffer_prefix_bytes: tuple[int, ...] | None = None
    # tensors several layers hold (tied weights, a module called at two depths): counted in the
    # prefix sums at their first holder only (a lower bound of any stage's state, which the
    # bound's DPs may use), and added back by `param_bytes` & co. to a stage that holds one
    # without its first holder: exact for a stage, each tensor once
    shared: tuple[SharedTensor, ...] = ()
    # the same for activations: a tensor several layers save (a tanh's output that the next
    # Linear saves as its input) is kept once by a stage holding them (`activation_bytes`);
    # `layer_activation` keeps each layer's own figure (a recomputed block holds all of it)
    shared_saved: tuple[SharedTensor, ...] = ()
    layer_activation: tuple[int, ...] = ()
    # one optimizer step, per optimizer name: prefix sums of the layers' `optimizer_ms` (speed
    # 1; independent of the batch); empty where the profile has none
    optimizer_prefix_ms: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # prefix counts of the layers whose backward runs only whole (`LayerProfile.split_backward`
    # false): ZB-H1 fuses a stage holding one. Empty: none
    whole_backward_prefix: tuple[int, ...] = ()
    # per (what, start, stop): the stage totals that scan every tensor (`_memo`); the search
    # asks for the same stages thousands of times
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False, hash=False)

    def _memo(self, what: str, start: int, stop: int, fn):
        key = (what, start, stop)
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = fn(start, stop)
        return got

    @property
    def num_layers(self) -> int:
        return len(self.names)

    def at_degree(self, degree: int) -> TPTable:
        """The layers on one of `degree` TP devices (a PipeplanError if not profiled)."""
        for x in self.tp:
            if x.degree == degree:
                return x
        have = ", ".join(str(x.degree) for x in self.tp) or "none"
        raise PipeplanError(f"tensor-parallel degree {degree} was not profiled (profiled: {have}); "
                            f"profile the model with --tp {degree}")

    def fwd_ms(self, start: int, stop: int) -> float:
        return self.fwd_prefix_ms[stop] - self.fwd_prefix_ms[start]

    def bwd_ms(self, start: int, stop: int) -> float:
        return self.bwd_prefix_ms[stop] - self.bwd_prefix_ms[start]

    def bwd_weight_ms(self, start: int, stop: int) -> float:
        """W of layers start..stop-1; B (`bwd_input`) is `bwd_ms - bwd_weight_ms`."""
        if self.bwd_weight_prefix_ms is None:
            return 0.5 * self.bwd_ms(start, stop)
        return self.bwd_weight_prefix_ms[stop] - self.bwd_weight_prefix_ms[start]

    def weight_grad_bytes(self, start: int, stop: int) -> int:
        return self._memo("weight_grad_bytes", start, stop, self._weight_grad_bytes)

    def _weight_grad_bytes(self, start: int, stop: int) -> int:
        """Gradients a stage of layers start..stop-1 keeps from B until W at the intermediates
        where weights join the input path (split backward): each layer's, less the outputs'
        gradients of layers whose outputs all leave the stage (the stage keeps those as its
        outputs' gradients: `output_bytes`)."""
        if self.weight_grad_prefix_bytes is None:
            return 0
        total = self.weight_grad_prefix_bytes[stop] - self.weight_grad_prefix_bytes[start]
        if self.weight_grad_output_bytes:
            produced = {t.producer for t in self.tensors if start <= t.producer < stop}
            inside = {t.producer for t in self.tensors if start <= t.producer < stop and t.consumers[0] < stop}
            total -= sum(self.weight_grad_output_bytes[i] for i in produced - inside)
        return total

    def output_bytes(self, start: int, stop: int) -> int:
        return self._memo("output_bytes", start, stop, self._output_bytes)

    def _output_bytes(self, start: int, stop: int) -> int:
        """Bytes of the tensors layers start..stop-1 produce for later layers, each once: what a
        stage ending there sends on, and the gradients it receives back."""
        return sum(t.nbytes for t in self.tensors if start <= t.producer < stop and t.consumers[-1] >= stop)

    def layer_activation_bytes(self, i: int) -> int:
        """What layer i saves when it runs alone (a recomputed block), shared tensors included."""
        if self.layer_activation:
            return self.layer_activation[i]
        return self.activation_prefix_bytes[i + 1] - self.activation_prefix_bytes[i]

    def recompute_bytes(self, start: int, stop: int) -> tuple[int, int]:
        return self._memo("recompute_bytes", start, stop, self._recompute_bytes)

    def _recompute_bytes(self, start: int, stop: int) -> tuple[int, int]:
        """Recomputation of layers start..stop-1, each its own checkpointed block: (bytes kept
        per microbatch = every tensor the blocks read, each once, plus on the last stage what
        the loss saves, since the loss runs outside the blocks; bytes one block's recomputed
        forward holds during the backward = the largest layer's activations less its own inputs,
        which the stage keeps already, and the loss's)."""
        kept = sum(t.nbytes for t in self.tensors if any(start <= c < stop for c in t.consumers))
        loss = self.loss_activation_bytes if stop == self.num_layers else 0
        own = self.saved_input_bytes or (0,) * self.num_layers  # kept already: not again
        peak = max((self.layer_activation_bytes(i) - own[i] - (loss if i == self.num_layers - 1 else 0)
                    for i in range(start, stop)), default=0)
        return kept + loss, max(peak, 0)

    def optimizer_ms(self, optimizer: str, start: int, stop: int) -> float:
        """One `optimizer` step over layers start..stop-1 (0 where the profile did not measure it)."""
        for name, prefix in self.optimizer_prefix_ms:
            if name == optimizer:
                return prefix[stop] - prefix[start]
        return 0.0

    def optimizer_prefix(self, optimizer: str) -> tuple[float, ...] | None:
        return next((p for name, p in self.optimizer_prefix_ms if name == optimizer), None)

    def compute_ms(self, start: int, stop: int) -> float:
        return self.fwd_ms(start, stop) + self.bwd_ms(start, stop)

    def param_bytes(self, start: int, stop: int) -> int:
        """The model state a device of a stage of these layers holds: parameters and buffers
        (`layer_table`; `buffer_bytes` of it are buffers), a tensor several hold once."""
        return (self.param_prefix_bytes[stop] - self.param_prefix_bytes[start]
                + _held_back(self.shared, ("trained", "frozen", "buffer"), start, stop))

    def frozen_bytes(self, start: int, stop: int) -> int:
        """Of `param_bytes`, what takes no gradient (nor optimizer state, nor all-reduce):
        frozen parameters and buffers."""
        z = self.frozen_prefix_bytes
        return (0 if z is None else z[stop] - z[start]) + _held_back(self.shared, ("frozen", "buffer"), start, stop)

    def buffer_bytes(self, start: int, stop: int) -> int:
        """Of `param_bytes`, the layers' buffers."""
        z = self.buffer_prefix_bytes
        return (0 if z is None else z[stop] - z[start]) + _held_back(self.shared, ("buffer",), start, stop)

    def activation_bytes(self, start: int, stop: int) -> int:
        return (self.activation_prefix_bytes[stop] - self.activation_prefix_bytes[start]
                + _held_back(self.shared_saved, ("saved",), start, stop))

    def cut_bytes(self) -> list[int]:
        """`result[i]` = bytes of every non-input tensor produced at or before layer i and used
        after it (a chain cut between layers i and i+1; what PipeDream's DP uses), i < L-1."""
        spans = ((t.producer, t.consumers[-1], t.nbytes) for t in self.tensors if t.producer >= 0)
        return crossing_bytes(spans, self.num_layers)


@dataclass(frozen=True)
class TPTable:
    """Prefix sums of the layers as they run on one of `degree` tensor-parallel devices."""

    degree: int
    fwd_prefix_ms: tuple[float, ...]
    bwd_prefix_ms: tuple[float, ...]
    param_prefix_bytes: tuple[int, ...]
    activation_prefix_bytes: tuple[int, ...]
    ar_fwd_prefix_bytes: tuple[int, ...]  # TP all-reduce bytes per profiled batch
    ar_bwd_prefix_bytes: tuple[int, ...]
    ar_fwd_prefix_count: tuple[int, ...]  # TP collectives per microbatch
    ar_bwd_prefix_count: tuple[int, ...]

    def span(self, name: str, start: int, stop: int) -> float:
        p = getattr(self, name)
        return p[stop] - p[start]


def tp_tables(profile: Profile) -> tuple[TPTable, ...]:
    """A table per degree every layer was profiled at (`LayerProfile.tp`)."""
    layers = profile.layers
    degrees = set.intersection(*[{x.degree for x in (layer.tp or [])} for layer in layers])
    out = []
    for t in sorted(degrees):
        xs = [layer.at_degree(t) for layer in layers]
        fwd = [x.fwd_ms for x in xs]  # type: ignore[union-attr]
        fwd[-1] += loss_ms(profile)  # every TP rank computes the loss on the whole output
        act = [x.activation_bytes for x in xs]  # type: ignore[union-attr]
        act[-1] += loss_activation_bytes(profile)
        out.append(TPTable(
            degree=t, fwd_prefix_ms=_prefix(fwd), bwd_prefix_ms=_prefix([x.bwd_ms for x in xs]),  # type: ignore[union-attr]
            param_prefix_bytes=_prefix([x.param_bytes for x in xs]),  # type: ignore[union-attr]
            activation_prefix_bytes=_prefix(act),
            ar_fwd_prefix_bytes=_prefix([x.allreduce_bytes_fwd for x in xs]),  # type: ignore[union-attr]
            ar_bwd_prefix_bytes=_prefix([x.allreduce_bytes_bwd for x in xs]),  # type: ignore[union-attr]
            ar_fwd_prefix_count=_prefix([x.allreduces_fwd for x in xs]),  # type: ignore[union-attr]
            ar_bwd_prefix_count=_prefix([x.allreduces_bwd for x in xs]),  # type: ignore[union-attr]
        ))
    return tuple(out)


def _prefix(values: Sequence[float]) -> tuple:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


def profile_tensors(profile: Profile) -> list[Tensor]:
    """Tensors of the profile's graph, each once (an edge's value is `edge.tensor or edge.src`).
    A profile without edges is read as a chain: layer i's output feeds layer i+1."""
    index = profile.layer_index()
    if not profile.edges:
        return [Tensor(i, (i + 1,), layer.output_bytes) for i, layer in enumerate(profile.layers[:-1])]
    acc: dict[tuple[str, str], tuple[int, set[int], int]] = {}
    for e in profile.edges:
        key = (e.src, e.tensor or e.src)
        producer = -1 if e.src == INPUT_NODE else index[e.src]
        _, consumers, nbytes = acc.setdefault(key, (producer, set(), 0))
        consumers.add(index[e.dst])
        acc[key] = (producer, consumers, max(nbytes, e.bytes))
    return [Tensor(p, tuple(sorted(c)), b) for p, c, b in acc.values()]


def loss_ms(profile: Profile) -> float:
    """The loss's forward and backward time, when the profiler measured it (`measured.loss_ms`);
    the stage holding the model's output pays it."""
    return float(profile.measured.loss_ms or 0.0) if profile.measured else 0.0


def loss_activation_bytes(profile: Profile) -> int:
    """What the loss keeps for its backward (`measured.loss_activation_bytes`, e.g. the
    log-probabilities of a cross-entropy), per profiled batch, when the profiler measured it."""
    return (profile.measured.loss_activation_bytes or 0) if profile.measured else 0


def loss_workspace_bytes(profile: Profile) -> int:
    """What the loss's backward allocates at its peak beyond what the loss saved
    (`measured.loss_workspace_bytes`: a cross-entropy's gradients of its log-probabilities and
    of the logits), per profiled batch; the last stage holds it while its backward (B) runs.
    0 for profiles made before it was measured."""
    return (profile.measured.loss_workspace_bytes or 0) if profile.measured else 0


def reserved_memory_bytes(profile: Profile, cluster: Cluster) -> float:
    """Memory of every device the model cannot use: the cluster's `reserved_memory_gb` where
    given, else what the profiler measured the CUDA libraries keep (`device.workspace_bytes`;
    0 for a CPU profile)."""
    if cluster.reserved_memory_gb is not None:
        return cluster.reserved_memory_gb * GB
    return float(getattr(profile.device, "workspace_bytes", 0) or 0)


DEFAULT_WEIGHT_SHARE = 0.5  # of bwd_ms, for a layer with parameters and no measured bwd_weight_ms


def default_bwd_weight_ms(bwd_ms: float, param_bytes: int) -> float:
    """W of a layer whose profile predates the B / W split: none without parameters, else
    `DEFAULT_WEIGHT_SHARE` of its backward."""
    return DEFAULT_WEIGHT_SHARE * bwd_ms if param_bytes > 0 else 0.0


def layer_bwd_weight_ms(layer: object) -> float:
    """A layer's W: measured (`bwd_weight_ms`, rescaled so B + W = bwd_ms) or the default."""
    bwd = float(layer.bwd_ms)  # type: ignore[attr-defined]
    bi = getattr(layer, "bwd_input_ms", None)
    bw = getattr(layer, "bwd_weight_ms", None)
    if bw is None:
        return default_bwd_weight_ms(bwd, int(layer.param_bytes))  # type: ignore[attr-defined]
    total = float(bw) + float(bi or 0.0)
    return bwd * float(bw) / total if total > 0 else 0.0


def layer_table(profile: Profile) -> LayerTable:
    """The profile as prefix sums; the loss's time and saved bytes are the last layer's."""
    layers = profile.layers
    fwd = [x.fwd_ms for x in layers]
    fwd[-1] += loss_ms(profile)
    activation = [x.activation_bytes for x in layers]
    activation[-1] += loss_activation_bytes(profile)
    raw_activation = tuple(activation)
    saved = shared_saved_tensors(profile)
    for t in saved:  # counted at the first layer saving it only (`LayerTable.shared_saved`)
        for i in t.others:
            activation[i] -= t.nbytes
    buffers = [int(getattr(x, "buffer_bytes", 0) or 0) for x in layers]
    params = [int(x.param_bytes) for x in layers]
    frozen_params = [int(getattr(x, "frozen_param_bytes", 0) or 0) for x in layers]
    shared = shared_tensors(profile)
    for t in shared:  # counted at the first holder only (`LayerTable.shared`)
        for i in t.others:
            if t.kind == "buffer":
                buffers[i] -= t.nbytes
            else:
                params[i] -= t.nbytes
                if t.kind == "frozen":
                    frozen_params[i] -= t.nbytes
    frozen = [z + b for z, b in zip(frozen_params, buffers, strict=True)]
    whole = [int(getattr(x, "split_backward", None) is False) for x in layers]
    return LayerTable(
        batch_size=profile.batch_size,
        names=tuple(x.name for x in layers),
        fwd_prefix_ms=_prefix(fwd),
        bwd_prefix_ms=_prefix([x.bwd_ms for x in layers]),
        param_prefix_bytes=_prefix([p + b for p, b in zip(params, buffers, strict=True)]),
        activation_prefix_bytes=_prefix(activation),
        tensors=tuple(profile_tensors(profile)),
        bwd_weight_prefix_ms=_prefix([layer_bwd_weight_ms(x) for x in layers]),
        weight_grad_prefix_bytes=_prefix([int(getattr(x, "weight_grad_bytes", 0) or 0) for x in layers]),
        weight_grad_output_bytes=tuple(int(getattr(x, "weight_grad_output_bytes", 0) or 0) for x in layers),
        saved_input_bytes=tuple(int(getattr(x, "saved_input_bytes", 0) or 0) for x in layers),
        tp=tp_tables(profile),
        loss_activation_bytes=loss_activation_bytes(profile),
        loss_workspace_bytes=loss_workspace_bytes(profile),
        frozen_prefix_bytes=_prefix(frozen) if any(frozen) else None,
        buffer_prefix_bytes=_prefix(buffers) if any(buffers) else None,
        optimizer_prefix_ms=optimizer_prefixes(layers),
        shared=tuple(shared),
        shared_saved=tuple(saved),
        layer_activation=raw_activation if saved else (),
        whole_backward_prefix=_prefix(whole) if any(whole) else (),
    )


def shared_saved_tensors(profile: Profile) -> list[SharedTensor]:
    """The profile's `shared_saved` entries (a tensor several layers save for backward, with
    its bytes) the cost model can count once per stage (`_counted_once`)."""
    return _counted_once(profile, [(e.layers, e.bytes, "saved") for e in profile.shared_saved or []],
                         [{"saved": int(x.activation_bytes)} for x in profile.layers])


def shared_tensors(profile: Profile) -> list[SharedTensor]:
    """The profile's `shared_parameters` the cost model can count once per stage
    (`_counted_once`; profiles before their bytes have none: each holder counts the tensor)."""
    entries = [(e.layers, e.bytes, "buffer" if e.buffer else "frozen" if e.frozen else "trained")
               for e in profile.shared_parameters or []]
    left = []
    for x in profile.layers:
        frozen = int(getattr(x, "frozen_param_bytes", 0) or 0)
        left.append({"trained": int(x.param_bytes) - frozen, "frozen": frozen,
                     "buffer": int(getattr(x, "buffer_bytes", 0) or 0)})
    return _counted_once(profile, entries, left)


def _counted_once(profile: Profile, entries: list[tuple[list[str], int | None, str]],
                  left: list[dict[str, int]]) -> list[SharedTensor]:
    """Of `entries` (layer names, bytes, kind), those that every holder's own figures contain
    (`left[i][kind]`: what layer i's figures hold that no entry kept so far takes), as
    SharedTensors; others are ignored (each holder counts the tensor, as before)."""
    index = {x.name: i for i, x in enumerate(profile.layers)}
    out = []
    for names, nbytes, kind in entries:
        if not nbytes or not all(n in index for n in names):
            continue
        holders = sorted({index[n] for n in names})
        if len(holders) < 2 or any(left[i][kind] < nbytes for i in holders):
            continue
        for i in holders[1:]:
            left[i][kind] -= nbytes
        out.append(SharedTensor(holders[0], tuple(holders[1:]), nbytes, kind))
    return out


def optimizer_prefixes(layers: Sequence[object]) -> tuple[tuple[str, tuple[float, ...]], ...]:
    """Per optimizer any layer has a measured step for (`LayerProfile.optimizer_ms`), the
    prefix sums of the layers' steps (0 for a layer without the figure)."""
    per = [getattr(x, "optimizer_ms", None) or {} for x in layers]
    names = sorted({k for d in per for k in d})
    return tuple((k, _prefix([float(d.get(k, 0.0)) for d in per])) for k in names)


# ---------------------------------------------------------------- scalar formulas


def microbatch_scale(profile_batch_size: int, microbatch_size: int) -> float:
    """Times and per-sample bytes scale linearly with the microbatch size."""
    return microbatch_size / profile_batch_size


def stage_fwd_ms(table: LayerTable, start: int, stop: int, scale: float, speed: float) -> float:
    return scale * table.fwd_ms(start, stop) / speed


def stage_bwd_ms(table: LayerTable, start: int, stop: int, scale: float, speed: float) -> float:
    return scale * table.bwd_ms(start, stop) / speed


def link_kind(devices: Sequence[Device], a: Sequence[int], b: Sequence[int] = ()) -> LinkKind:
    """`intra` if every device of both sets is on one node, else `inter`."""
    nodes = {devices[d].node for d in a} | {devices[d].node for d in b}
    return "intra" if len(nodes) <= 1 else "inter"


def link_gb_per_s(cluster: Cluster, kind: LinkKind) -> float:
    return cluster.intra_node_gb_per_s if kind == "intra" else cluster.inter_node_gb_per_s


def link_latency_us(cluster: Cluster, kind: LinkKind) -> float:
    """Per-message latency of a link class: the measured one (`intra_node_latency_us`,
    `inter_node_latency_us`, written by calibrate) or the cluster's `latency_us`."""
    v = cluster.intra_node_latency_us if kind == "intra" else cluster.inter_node_latency_us
    return cluster.latency_us if v is None else v


def transfer_ms(nbytes: float, gb_per_s: float, latency_us: float = 0.0) -> float:
    """One point-to-point transfer; zero bytes take zero time."""
    if nbytes <= 0:
        return 0.0
    return nbytes / (gb_per_s * GB) * 1e3 + latency_us / 1e3


def allreduce_ms(param_bytes: float, replicas: int, gb_per_s: float, latency_us: float = 0.0) -> float:
    """Ring all-reduce of the gradients: `2 (r-1)/r * bytes / bw + 2 (r-1) * latency`."""
    if replicas <= 1 or param_bytes <= 0:
        return 0.0
    r = replicas
    return 2 * (r - 1) / r * param_bytes / (gb_per_s * GB) * 1e3 + 2 * (r - 1) * latency_us / 1e3


def tp_allreduce_ms(nbytes: float, count: float, degree: int, gb_per_s: float,
                    latency_us: float = 0.0) -> float:
    """TP collectives of one stage and microbatch: `count` ring all-reduces over `degree`
    devices moving `nbytes` in all: `2 (t-1)/t * bytes / bw + count * 2 (t-1) * latency`.
    Linear in both, so a stage's figure is the sum of its layers' (the bound's prefix sums,
    `search.bound._variants`): a layer profiled with bytes but no count is priced its bytes
    (it was priced 0 where its stage had no count, above the bound's own price: an OPTIMAL
    claimed over a plan that was not the best)."""
    if degree <= 1:
        return 0.0
    t = degree
    return 2 * (t - 1) / t * nbytes / (gb_per_s * GB) * 1e3 + count * 2 * (t - 1) * latency_us / 1e3


def static_memory_bytes(param_bytes: float, optimizer: str, frozen_bytes: float = 0.0) -> float:
    """Parameters, gradients and `0 | 1 | 2` optimizer copies for `sgd | momentum | adam`; the
    `frozen_bytes` of them (no gradient) only once: `param * (2 + k) - frozen * (1 + k)`."""
    k = OPTIMIZER_EXTRA_COPIES[optimizer]
    return param_bytes * (2 + k) - frozen_bytes * (1 + k)


def stage_memory_bytes(param_bytes: float, activation_bytes: float, scale: float,
                       inflight: int, optimizer: str, frozen_bytes: float = 0.0) -> float:
    """Peak memory of one device of a stage: `static_memory_bytes + scale * act * inflight`."""
    return static_memory_bytes(param_bytes, optimizer, frozen_bytes) + scale * activation_bytes * inflight


def replica_microbatches(num_microbatches: int, replicas: int, replica: int) -> int:
    """How many of the iteration's microbatches replica `replica` runs (`j % r == replica`)."""
    return len(range(replica, num_microbatches, replicas))


def warmup_1f1b(num_microbatches: int, stage_replicas: Sequence[int], stage: int, replica: int = 0) -> int:
    """1F1B warm-up forwards of one replica of stage s: `min(m_k, ceil(sum(r_t, t >= s) / r_s))`.

    Without replication this is PipeDream-Flush's `min(m, S - s)`. With replication it keeps as
    many microbatches in flight as the downstream replicas can work on at once (a balanced
    pipeline has sum(r_t) microbatches between stage s and the end, spread over r_s replicas)."""
    r = stage_replicas[stage]
    m_k = replica_microbatches(num_microbatches, r, replica)
    return min(m_k, -(-sum(stage_replicas[stage:]) // r))


def peak_inflight(schedule: str, num_microbatches: int, stage_replicas: Sequence[int], stage: int) -> int:
    """Peak microbatches whose forward is done and backward is not, on one replica (the
    busiest, replica 0), as the generated schedule keeps them."""
    m_0 = replica_microbatches(num_microbatches, stage_replicas[stage], 0)
    if schedule == "gpipe":
        return m_0
    return warmup_1f1b(num_microbatches, stage_replicas, stage, 0)


def lower_bound_ms(table: LayerTable, num_microbatches: int, scale: float, total_speed: float) -> float:
    """Perfect balance, no bubble, no communication: `m * scale * sum(fwd + bwd) / sum(speed)`,
    each layer's work the least of its profiled ways to run (whole, or t x its time on one of
    t tensor-parallel devices: a profile's shards may take less than 1/t of the layer)."""
    work = sum(least_layer_ms(table, [tt.degree for tt in table.tp])[0]) if table.tp else \
        table.compute_ms(0, table.num_layers)
    return num_microbatches * scale * work / total_speed


def least_layer_ms(table: LayerTable, degrees: Sequence[int], zero_bubble: bool = False
                   ) -> tuple[list[float], list[float]]:
    """Per layer, over running it whole or on one of t TP devices for t in `degrees`: the
    least device time of its forward and backward (t x the shard's) and the least time on
    the way of one microbatch through the model. Under `zero_bubble` (zb-h1) that way runs
    through each layer's B only (its share `bwd_weight / bwd` of the backward being W, which
    may wait for the end), but for the first layer's whole backward, as the bound's
    (`planner.search.bound`: the first stage's last W is sure to follow its last B)."""
    L = table.num_layers
    keep = [1.0] * L  # the share of a layer's backward on that way
    if zero_bubble:
        for i in range(1, L):
            bwd = table.bwd_ms(i, i + 1)
            keep[i] = 1.0 - table.bwd_weight_ms(i, i + 1) / bwd if bwd > 0 else 1.0
    work = [table.compute_ms(i, i + 1) for i in range(L)]
    latency = [table.fwd_ms(i, i + 1) + keep[i] * table.bwd_ms(i, i + 1) for i in range(L)]
    for t in degrees:
        if t > 1:
            tt = table.at_degree(t)
            for i in range(L):
                fwd, bwd = tt.span("fwd_prefix_ms", i, i + 1), tt.span("bwd_prefix_ms", i, i + 1)
                work[i] = min(work[i], t * (fwd + bwd))
                latency[i] = min(latency[i], fwd + keep[i] * bwd)
    return work, latency


# ---------------------------------------------------------------- a whole candidate


TRAFFIC_KEPT = 4096  # stage boundaries whose traffic a table keeps (`stage_traffic_bytes`)


def stage_traffic_bytes(table: LayerTable, bounds: Sequence[int]) -> dict[tuple[int, int], int]:
    """Bytes per profiled batch sent from stage s to each later stage t, keyed `(s, t)`.

    `bounds` are the stage boundaries `[0, stop_0, stop_1, ..., L]`. Every tensor produced in s
    and consumed in t counts once per (s, t); model inputs are loaded where used, not sent. Every
    pair with a crossing tensor appears, even with zero bytes (it is still a dependency)."""
    key = tuple(bounds)
    kept = table._cache.setdefault("stage_traffic", OrderedDict())  # the search's, bounded
    got = kept.get(key)
    if got is not None:
        kept.move_to_end(key)
        return dict(got)
    stops = list(bounds[1:])
    out: dict[tuple[int, int], int] = {}
    for t in table.tensors:
        if t.producer < 0:
            continue
        s = bisect.bisect_right(stops, t.producer)
        seen: set[int] = set()
        for c in t.consumers:
            dst = bisect.bisect_right(stops, c)
            if dst != s and dst not in seen:
                seen.add(dst)
                out[(s, dst)] = out.get((s, dst), 0) + t.nbytes
    kept[key] = dict(out)
    if len(kept) > TRAFFIC_KEPT:
        kept.popitem(last=False)
    return out


@dataclass(frozen=True)
class Send:
    nbytes: float  # per microbatch (scaled); the same bytes return as gradients
    ms: float  # transfer time, each direction


@dataclass(frozen=True)
class PipelineCosts:
    """Every number the simulator needs for one candidate, per stage unless said otherwise."""

    stage_devices: tuple[tuple[int, ...], ...]
    num_microbatches: int
    fwd_ms: tuple[float, ...]  # per microbatch
    bwd_ms: tuple[float, ...]
    allreduce_ms: tuple[float, ...]  # per iteration, after the stage's last backward
    static_memory_bytes: tuple[float, ...]  # parameters, gradients, optimizer state
    activation_bytes_per_microbatch: tuple[float, ...]  # scaled
    memory_limit_bytes: tuple[float, ...]  # smallest device of the stage
    sends: dict[tuple[int, int], Send]  # (s, t) -> traffic; (s-1, s) always present
    # zero bubble, where a schedule has W actions: B and W of each stage (default: bwd_ms -
    # bwd_weight_ms and bwd_weight_ms, which defaults to half of bwd_ms)
    bwd_weight_ms: tuple[float, ...] | None = None
    bwd_input_ms: tuple[float, ...] | None = None
    # bytes a microbatch keeps between its B and its W (default: activation_bytes_per_microbatch)
    weight_hold_bytes_per_microbatch: tuple[float, ...] | None = None
    # bytes held only while a backward runs (one recomputed block's activations)
    transient_bytes: tuple[float, ...] | None = None
    # bytes held only while a B runs (the loss's backward working memory on the last stage;
    # a split first stage, whose W runs the whole backward, has it in transient_bytes instead)
    loss_transient_bytes: tuple[float, ...] | None = None
    recompute: tuple[bool, ...] | None = None
    # one optimizer step per iteration on every device of the stage, after its all-reduce
    # (None: not measured, 0)
    optimizer_ms: tuple[float, ...] | None = None
    # stages whose backward runs only whole (a layer's `split_backward` false): ZB-H1 fuses them
    whole_backward: tuple[bool, ...] | None = None

    def bwd_split(self, s: int) -> tuple[float, float]:
        """(B, W) of stage s when its backward is split."""
        w = self.bwd_weight_ms[s] if self.bwd_weight_ms is not None else 0.5 * self.bwd_ms[s]
        b = self.bwd_input_ms[s] if self.bwd_input_ms is not None else self.bwd_ms[s] - w
        return b, w
    # tensor parallelism: stage_devices holds the first rank of each replica; a stage's
    # replicas each span tp[s] devices; tp_comm_fwd_ms[s] / tp_comm_bwd_ms[s] = the TP
    # all-reduces of one microbatch's forward / backward, already inside fwd_ms / bwd_ms.
    # Empty: no stage is tensor-parallel.
    tp: tuple[int, ...] = ()
    tp_comm_fwd_ms: tuple[float, ...] = ()
    tp_comm_bwd_ms: tuple[float, ...] = ()

    @property
    def tp_comm_ms(self) -> tuple[float, ...]:
        """Per stage, TP all-reduce time of one microbatch, forward + backward."""
        return tuple(f + b for f, b in zip(self.tp_comm_fwd_ms, self.tp_comm_bwd_ms, strict=True))

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)


def stages_without_input_grad(candidate: Candidate, stage: object) -> bool:
    """The first stage receives no tensor whose gradient it must send back."""
    return stage is candidate.stages[0]


StageCost = tuple[float, ...]  # `_stage_cost`: f, bwd, B, W, act, transient, hold, ar, static, limit, tp f, tp b, loss transient, optimizer


def _stage_cost(table: LayerTable, cluster: Cluster, devices: Sequence[Device], st: StageChoice, i: int,
                first: bool, scale: float, optimizer: str) -> StageCost:
    """Stage `st`'s numbers in `pipeline_costs` (`first`: it is the candidate's first stage)."""
    speed = min(devices[d].speed for d in st.devices)
    t = getattr(st, "tp", 1)
    w_share = table.bwd_weight_ms(st.start, st.stop) / max(table.bwd_ms(st.start, st.stop), 1e-300)
    tp_f = tp_b = 0.0
    frozen = 0  # (a TP shard's frozen part is not profiled: its parameters all count as trained)
    opt = table.optimizer_ms(optimizer, st.start, st.stop) / speed
    if t == 1:
        f = stage_fwd_ms(table, st.start, st.stop, scale, speed)
        full_bwd = stage_bwd_ms(table, st.start, st.stop, scale, speed)
        params = table.param_bytes(st.start, st.stop)
        frozen = table.frozen_bytes(st.start, st.stop)
        full = scale * table.activation_bytes(st.start, st.stop)
    else:  # the shard's measured time plus its TP all-reduces on the node's links
        if st.recompute:
            raise PipeplanError(f"stage {i}: recomputation of a tensor-parallel stage is not "
                                "supported yet; use --recompute 0 on it or --tp 1")
        tt = table.at_degree(t)
        for k in range(st.replicas):
            if link_kind(devices, st.devices[k * t:(k + 1) * t]) != "intra":
                raise PipeplanError(f"stage {i}: the tensor-parallel group of replica {k} "
                                    f"(devices {list(st.devices[k * t:(k + 1) * t])}) spans "
                                    "nodes; a TP group must stay inside one node")
        gbps, lat = link_gb_per_s(cluster, "intra"), link_latency_us(cluster, "intra")
        tp_f = tp_allreduce_ms(scale * tt.span("ar_fwd_prefix_bytes", st.start, st.stop),
                               tt.span("ar_fwd_prefix_count", st.start, st.stop), t, gbps,
                               lat) / cluster.allreduce_efficiency
        tp_b = tp_allreduce_ms(scale * tt.span("ar_bwd_prefix_bytes", st.start, st.stop),
                               tt.span("ar_bwd_prefix_count", st.start, st.stop), t, gbps,
                               lat) / cluster.allreduce_efficiency
        f = scale * tt.span("fwd_prefix_ms", st.start, st.stop) / speed + tp_f
        full_bwd = scale * tt.span("bwd_prefix_ms", st.start, st.stop) / speed + tp_b
        params = tt.span("param_prefix_bytes", st.start, st.stop)
        full = scale * tt.span("activation_prefix_bytes", st.start, st.stop)
        buffers = table.buffer_bytes(st.start, st.stop)
        whole = table.param_bytes(st.start, st.stop) - buffers  # a shard steps its share of the parameters
        opt *= min(params / whole, 1.0) if whole > 0 else 0.0
        # every rank of a TP group holds the layers' buffers whole: model state without
        # gradient, optimizer state or all-reduce, as on one device
        params, frozen = params + buffers, buffers
    # zero bubble: B and W of the backward (a TP stage splits in the unsharded ratio)
    w = full_bwd * min(w_share, 1.0)
    if first:
        w = full_bwd  # nothing to send back: the whole backward runs in W (runtime's choice)
    # recomputation runs the forward once more, in the backward's B (before W)
    bwd = full_bwd + (f if st.recompute else 0.0)
    inp = full_bwd - w + (f if st.recompute else 0.0)
    # split and recomputed: W differentiates from the stage's outputs again (runtime's
    # split_backward `direct`), the backward and the recomputation once more
    wgt = full_bwd + f if st.recompute else w
    # from B until W a microbatch keeps what its forward saved (the retained graph), the
    # gradients of the stage's outputs, and, unless W differentiates from the outputs (a
    # stage whose inputs need no gradient, a recomputed stage: `direct`), the gradients at
    # the intermediates where weights join the input path (`weight_grad_bytes`). A
    # recomputed stage's graph keeps only the blocks' inputs (its recomputed activations
    # are freed once B has used them; W recomputes them again).
    out_grads = scale * table.output_bytes(st.start, st.stop)
    if st.recompute:
        kept, peak = table.recompute_bytes(st.start, st.stop)
        act, transient, hold = scale * kept, scale * peak, scale * kept + out_grads
    else:
        act, transient = full, 0.0
        hold = full + out_grads + (0.0 if first else scale * table.weight_grad_bytes(st.start, st.stop))
    # the last stage's backward starts with the loss's, whose working memory is not saved
    # activations (`loss_workspace_bytes`): in B, or also in W where W runs the whole backward
    # (a split first stage) or differentiates from the loss again (split and recomputed,
    # `direct`). It is freed before a recomputed block's forward runs again, so the two count
    # as their larger
    loss_tr = scale * table.loss_workspace_bytes if st.stop == table.num_layers else 0.0
    if first or st.recompute:
        transient, loss_tr = max(transient, loss_tr), 0.0
    kind = link_kind(devices, st.devices)
    ar = allreduce_ms(params - frozen, st.replicas, link_gb_per_s(cluster, kind),
                      link_latency_us(cluster, kind)) / cluster.allreduce_efficiency
    return (f, bwd, inp, wgt, act, transient, hold, ar, static_memory_bytes(params, optimizer, frozen),
            min(devices[d].memory_bytes for d in st.devices), tp_f, tp_b, loss_tr, opt)


STAGE_COSTS_KEPT = 200_000  # entries of a `stage_cache` (`pipeline_costs`) before it is cleared


def pipeline_costs(table: LayerTable, cluster: Cluster, candidate: Candidate, optimizer: str,
                   devices: Sequence[Device] | None = None,
                   stage_cache: dict | None = None) -> PipelineCosts:
    """The cost model applied to one candidate (ARCHITECTURE.md, formula by formula).

    Stage s depends on stage s-1 even when no tensor crosses (the pipeline order); such a send
    has zero bytes and takes zero time. `stage_cache`: a dict kept between calls on the same
    table, cluster, devices and optimizer (the search's), where each stage's numbers are kept
    by the stage (its layers, devices, recomputation, TP degree), whether it is the first and
    the microbatch scale: the same floats, most of them looked up where a move changed one
    or two stages."""
    devices = devices if devices is not None else cluster.devices()
    scale = microbatch_scale(table.batch_size, candidate.microbatch_size)
    bounds = [0] + [st.stop for st in candidate.stages]
    fwd, bwd, ar, static, act, limit, tp_f, tp_b = [], [], [], [], [], [], [], []
    wgt, inp, hold, transient, loss_tr, opt = [], [], [], [], [], []
    for i, st in enumerate(candidate.stages):
        first = stages_without_input_grad(candidate, st)
        if stage_cache is None:
            x = _stage_cost(table, cluster, devices, st, i, first, scale, optimizer)
        else:
            key = (st.start, st.stop, st.devices, st.recompute, getattr(st, "tp", 1), first, scale)
            x = stage_cache.get(key)
            if x is None:
                x = _stage_cost(table, cluster, devices, st, i, first, scale, optimizer)
                if len(stage_cache) >= STAGE_COSTS_KEPT:
                    stage_cache.clear()
                stage_cache[key] = x
        f, b, b_in, b_w, a, tr, h, r, sm, lim, tf, tb, lt, o = x
        loss_tr.append(lt)
        opt.append(o)
        fwd.append(f)
        bwd.append(b)
        inp.append(b_in)
        wgt.append(b_w)
        act.append(a)
        transient.append(tr)
        hold.append(h)
        ar.append(r)
        static.append(sm)
        limit.append(lim)
        tp_f.append(tf)
        tp_b.append(tb)
    traffic = stage_traffic_bytes(table, bounds)
    for s in range(1, len(candidate.stages)):
        traffic.setdefault((s - 1, s), 0)
    sends = {}
    for (s, t), nbytes in sorted(traffic.items()):
        src, dst = candidate.stages[s].devices, candidate.stages[t].devices
        key = (src, dst, nbytes, scale)  # a tuple of devices first: no stage's key
        snd = None if stage_cache is None else stage_cache.get(key)
        if snd is None:
            kind = link_kind(devices, src, dst)
            scaled = scale * nbytes
            snd = Send(scaled, transfer_ms(scaled, link_gb_per_s(cluster, kind),
                                           link_latency_us(cluster, kind) + cluster.p2p_overhead_us))
            if stage_cache is not None:
                stage_cache[key] = snd
        sends[(s, t)] = snd
    tps = tuple(getattr(st, "tp", 1) for st in candidate.stages)
    return PipelineCosts(
        stage_devices=tuple(st.devices[::t] for st, t in zip(candidate.stages, tps, strict=True)),
        num_microbatches=candidate.num_microbatches,
        fwd_ms=tuple(fwd), bwd_ms=tuple(bwd), allreduce_ms=tuple(ar),
        static_memory_bytes=tuple(static), activation_bytes_per_microbatch=tuple(act),
        memory_limit_bytes=tuple(limit), sends=sends,
        bwd_weight_ms=tuple(wgt), bwd_input_ms=tuple(inp), weight_hold_bytes_per_microbatch=tuple(hold),
        transient_bytes=tuple(transient), loss_transient_bytes=tuple(loss_tr), recompute=tuple(st.recompute for st in candidate.stages),
        optimizer_ms=tuple(opt) if any(opt) else None,
        whole_backward=(tuple(table.whole_backward_prefix[st.stop] > table.whole_backward_prefix[st.start]
                              for st in candidate.stages) if table.whole_backward_prefix else None),
        **({"tp": tps, "tp_comm_fwd_ms": tuple(tp_f), "tp_comm_bwd_ms": tuple(tp_b)}
           if any(t > 1 for t in tps) else {}),
    )


def rank_memory_peak(actions: Sequence[Action], costs: PipelineCosts) -> tuple[int, float]:
    """(peak microbatches in flight, peak bytes held beyond the static memory) of one rank
    running `actions` in order. A microbatch holds `activation_bytes_per_microbatch` from its
    F until its backward is done: B, or W where the rank's actions include W (split), holding
    `weight_hold_bytes_per_microbatch` from B until W; while a backward (B, or a split W, which
    recomputes too) runs, `transient_bytes` more. Memory depends only on the order, not on
    the timing, so the simulator and the ZB-H1 generator both count it here. While a B runs,
    `loss_transient_bytes` more (the loss's backward, on the last stage)."""
    split = any(a.kind == "W" for a in actions)
    act = costs.activation_bytes_per_microbatch
    hold = costs.weight_hold_bytes_per_microbatch or act
    transient = costs.transient_bytes or (0.0,) * costs.num_stages
    loss_tr = costs.loss_transient_bytes or (0.0,) * costs.num_stages
    inflight = peak = 0
    held = peak_bytes = 0.0
    for a in actions:
        s = a.stage
        if a.kind == "F":
            inflight += 1
            peak = max(peak, inflight)
            held += act[s]
        else:
            peak_bytes = max(peak_bytes, held + transient[s] + (loss_tr[s] if a.kind == "B" else 0.0))
            if a.kind == "B" and split:
                held += hold[s] - act[s]
            else:
                held -= act[s] if a.kind == "B" else hold[s]
                inflight -= 1
        peak_bytes = max(peak_bytes, held)
    return peak, peak_bytes


def memory_codes(actions: Sequence[Action]) -> tuple[int, ...]:
    """The kinds of a rank's actions as `held_peak` reads them: 0 F, 1 B where the rank's
    actions include W (split), 2 B otherwise, 3 W."""
    split = any(a.kind == "W" for a in actions)
    return tuple(0 if a.kind == "F" else 3 if a.kind == "W" else 1 if split else 2 for a in actions)


def held_peak(codes: Sequence[int], act: float, hold: float, transient: float,
              loss_transient: float = 0.0) -> float:
    """`rank_memory_peak(actions, costs)[1]` of a rank whose actions are all of one stage, from
    their `memory_codes` and that stage's bytes: the same additions in the same order, so the
    same bytes to the bit, a few times faster (the search counts it for every candidate)."""
    held = peak = 0.0
    swap = hold - act
    for c in codes:
        if c == 0:
            held += act
        else:
            v = held + transient + (0.0 if c == 3 else loss_transient)
            if v > peak:
                peak = v
            if c == 1:
                held += swap
            elif c == 2:
                held -= act
            else:
                held -= hold
        if held > peak:
            peak = held
    return peak


def predicted_memory_bytes(costs: PipelineCosts, schedule: str) -> list[float]:
    """Peak memory per device of each stage under the generated schedule."""
    m = costs.num_microbatches
    replicas = [len(devs) for devs in costs.stage_devices]
    return [
        costs.static_memory_bytes[s]
        + costs.activation_bytes_per_microbatch[s] * peak_inflight(schedule, m, replicas, s)
        for s in range(costs.num_stages)
    ]
