"""The file formats (DESIGN.md): profile.json, cluster.json, plan.json, report.json.

Pydantic v2 models, one per file, plus the options a plan is made with. Extra fields are kept
in profiles, plans and reports (newer writers may add some); a cluster rejects unknown keys
because a misspelt bandwidth would silently fall back to a default.

Units: times in milliseconds (`_ms`), sizes in bytes (`_bytes`), memory in gigabytes and
bandwidth in gigabytes per second where 1 GB = 1e9 bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    model_validator,
)

from planner.errors import PipeplanError
from planner.limits import MAX_INT

SCHEMA_VERSION = 1
GB = 1e9
OptimizerName = Literal["sgd", "momentum", "adam"]
INPUT_NODE = "<input>"  # edge source for tensors that are model inputs (available before layer 0)


def _known_schema(v: int) -> int:
    if v > SCHEMA_VERSION:
        raise ValueError(f"schema_version {v}: written by a newer pipeplan (this one reads "
                         f"{SCHEMA_VERSION}); upgrade pipeplan")
    if v < 1:
        raise ValueError(f"schema_version {v}: not a pipeplan file version (1 or more)")
    return v


SchemaVersion = Annotated[int, AfterValidator(_known_schema)]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class _OpenFinite(_Open):
    """Open, and Infinity / NaN refused: what a measurement holds."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- profile.json


class ModelRef(_Open):
    path: str
    sha256: str


class DeviceInfo(_Open):
    type: str  # "cpu" | "cuda" | "gpu" (imported)
    name: str
    # what the CUDA libraries keep on the device for the whole run beyond the model's tensors
    # (cuBLAS workspaces), measured by the profiler on CUDA; the planner leaves it out of every
    # device's memory unless the cluster says otherwise (`Cluster.reserved_memory_gb`)
    workspace_bytes: NonNegativeInt = 0


class LayerTP(_OpenFinite):
    """A layer as it runs on one of `degree` tensor-parallel devices (profile --tp)."""

    degree: PositiveInt
    fwd_ms: NonNegativeFloat  # the shard's own work, measured
    bwd_ms: NonNegativeFloat
    param_bytes: NonNegativeInt  # the shard's parameters
    activation_bytes: NonNegativeInt  # saved for backward on one device, per profiled batch
    allreduce_bytes_fwd: NonNegativeInt = 0  # TP collectives per profiled batch (all-reduce
    allreduce_bytes_bwd: NonNegativeInt = 0  # equivalents: an all-gather of n counts n/2)
    allreduces_fwd: NonNegativeInt = 0  # how many collectives (each pays the link's latency)
    allreduces_bwd: NonNegativeInt = 0


class LayerProfile(_OpenFinite):

    name: str
    fwd_ms: NonNegativeFloat
    bwd_ms: NonNegativeFloat
    param_bytes: NonNegativeInt
    activation_bytes: NonNegativeInt  # bytes autograd keeps for backward, per profiled batch
    output_bytes: NonNegativeInt  # bytes of this layer's outputs, per profiled batch
    kind: str | None = None  # module class or description, for people
    # zero-bubble schedules: the backward split into the gradient of the layer's inputs (B) and
    # of its weights (W), measured separately. Absent in older profiles: planner.cost splits
    # bwd_ms (a layer without parameters is all B; others half B, half W).
    bwd_input_ms: NonNegativeFloat | None = None
    bwd_weight_ms: NonNegativeFloat | None = None
    # False: the layer's backward cannot run as B then W (a custom Function whose backward
    # reuses a tensor it saved, which a second pass finds changed): its B is the whole backward,
    # and ZB-H1 runs the backward of the stage that holds it as one (1F1B's, `fused_backward`).
    # Absent (None) or true: it splits (absent keeps the canonical form, and digest, of a profile)
    split_backward: bool | None = None
    # zero-bubble schedules: bytes of the gradients B keeps for W (at the intermediates where
    # the layer's weights join the input path; its outputs' gradients where one is such an
    # intermediate's, `weight_grad_output_bytes` of them), per profiled batch, measured with the
    # layer as a stage by itself. Recomputation: `saved_input_bytes`, the part of
    # activation_bytes that is the layer's own inputs. Absent in older profiles: 0.
    weight_grad_bytes: NonNegativeInt | None = None
    weight_grad_output_bytes: NonNegativeInt | None = None
    saved_input_bytes: NonNegativeInt | None = None
    tp: list[LayerTP] | None = None  # per tensor-parallel degree (profile --tp), if profiled
    # of param_bytes, the parameters that need no gradient (requires_grad=False: a frozen
    # backbone or embedding): no gradient, no optimizer state, no all-reduce. Absent: 0
    frozen_param_bytes: NonNegativeInt | None = None
    # one optimizer step over the layer's trainable parameters, per optimizer (`sgd`, `momentum`,
    # `adam`), measured; independent of the batch: a stage pays it once per iteration, after its
    # last backward and its all-reduce. Absent (older and imported profiles): 0
    optimizer_ms: dict[OptimizerName, NonNegativeFloat] | None = None
    # persistent and non-persistent buffers (BatchNorm statistics, attention masks, tables):
    # held on every device of the layer's stage, without gradient, optimizer state or
    # all-reduce (the profiler measures them; absent in older and imported profiles: 0)
    buffer_bytes: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _parts_within(self) -> LayerProfile:
        """A part is no larger than its whole (a profile edited by hand: a larger part lowered
        the predicted memory of a recomputed stage)."""
        if self.name == INPUT_NODE:
            raise ValueError(f"layer name {INPUT_NODE!r} is the marker of the model's inputs in "
                             "edges; rename the layer")
        for part, whole in (("frozen_param_bytes", "param_bytes"), ("saved_input_bytes", "activation_bytes"),
                            ("weight_grad_output_bytes", "weight_grad_bytes")):
            got, total = getattr(self, part), getattr(self, whole)
            if got is not None and got > (total or 0):
                raise ValueError(f"layer {self.name!r}: {part} {got} > {whole} {total or 0} (a part "
                                 "of it); give the profile pipeplan wrote")
        degrees = [x.degree for x in self.tp or []]
        if any(d < 2 for d in degrees) or len(set(degrees)) != len(degrees):
            raise ValueError(f"layer {self.name!r}: tp degrees {degrees}: each at least 2 (degree 1 "
                             "is the layer itself), none twice")
        return self

    def at_degree(self, degree: int) -> LayerTP | None:
        """The layer on one of `degree` TP devices (degree 1: the layer itself)."""
        if degree == 1:
            return LayerTP(degree=1, fwd_ms=self.fwd_ms, bwd_ms=self.bwd_ms,
                           param_bytes=self.param_bytes, activation_bytes=self.activation_bytes)
        return next((x for x in self.tp or [] if x.degree == degree), None)


class Edge(_Open):
    src: str  # a layer name or INPUT_NODE
    dst: str
    bytes: NonNegativeInt
    tensor: str | None = None  # the value carried; None means "the output of src"


class Measured(_OpenFinite):
    fwd_ms: NonNegativeFloat
    bwd_ms: NonNegativeFloat
    peak_memory_bytes: NonNegativeInt | None = None
    # the loss, measured apart: its forward + backward to the output, what it saves, and what
    # its backward allocates beyond that (the last stage holds each; planner.cost)
    loss_ms: NonNegativeFloat | None = None
    loss_activation_bytes: NonNegativeInt | None = None
    loss_workspace_bytes: NonNegativeInt | None = None
    # the whole pass (forward, loss, backward) on the wall clock: beside CPU-time figures
    # (`clock` thread) it shows time the model spends off its thread (waits, other threads)
    wall_ms: NonNegativeFloat | None = None


class SharedParameter(_Open):
    """A tensor several layers hold (a tied weight, a module called twice, a shared buffer):
    a stage holding several of `layers` holds it once (`planner.cost.shared_tensors`)."""

    keys: list[str] = Field(default_factory=list)  # its names in the model's state_dict
    layers: list[str]
    bytes: NonNegativeInt | None = None  # None (profiles before it): counted per layer
    frozen: bool | None = None  # requires_grad=False
    buffer: bool | None = None  # a buffer, not a parameter


class SharedSaved(_Open):
    """A tensor several layers save for their backward (a Tanh's output that the next Linear
    saves as its input): a stage holding several of `layers` keeps it once."""

    tensor: str | None = None  # the graph tensor (an edge's `tensor`)
    layers: list[str]
    bytes: NonNegativeInt


class Profile(_Open):
    schema_version: SchemaVersion = SCHEMA_VERSION
    model: ModelRef
    device: DeviceInfo
    batch_size: PositiveInt
    dtype: str = "float32"
    layers: list[LayerProfile] = Field(min_length=1)
    edges: list[Edge] = Field(default_factory=list)
    measured: Measured | None = None
    shared_parameters: list[SharedParameter] | None = None
    shared_saved: list[SharedSaved] | None = None

    @model_validator(mode="after")
    def _check_graph(self) -> Profile:
        index = {layer.name: i for i, layer in enumerate(self.layers)}
        if len(index) != len(self.layers):
            seen: set[str] = set()
            dup = next(x.name for x in self.layers if x.name in seen or seen.add(x.name))
            raise ValueError(f"layer name {dup!r} appears twice; layer names must be unique")
        for e in self.edges:
            if e.src != INPUT_NODE and e.src not in index:
                raise ValueError(f"edge {e.src!r} -> {e.dst!r}: unknown source layer {e.src!r}")
            if e.dst not in index:
                raise ValueError(f"edge {e.src!r} -> {e.dst!r}: unknown destination layer {e.dst!r}")
            if e.src != INPUT_NODE and index[e.src] >= index[e.dst]:
                raise ValueError(
                    f"edge {e.src!r} -> {e.dst!r} goes backwards: layers must be in topological order"
                )
        for field in ("shared_parameters", "shared_saved"):
            for k, entry in enumerate(getattr(self, field) or []):
                unknown = [n for n in entry.layers if n not in index]
                if unknown:
                    raise ValueError(f"{field}[{k}] names layer {unknown[0]!r}, which the profile does "
                                     f"not have; profile the model again (or remove the entry)")
        degrees = {x.degree for layer in self.layers for x in layer.tp or []}
        for t in sorted(degrees):  # `profile --tp` measures every layer at each degree
            lacking = [layer.name for layer in self.layers if layer.at_degree(t) is None]
            if lacking:
                raise ValueError(f"tensor-parallel degree {t} is profiled for some layers but not for "
                                 f"{', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''} "
                                 f"({len(lacking)} of {len(self.layers)}); profile the model again "
                                 f"with --tp {t}")
        return self

    def layer_index(self) -> dict[str, int]:
        return {layer.name: i for i, layer in enumerate(self.layers)}

    def cut_bytes(self) -> list[int]:
        """`result[i]` = bytes of every tensor produced at or before layer i and used after it
        (the traffic of a stage boundary between layer i and i+1), for i in 0..L-2. A tensor used
        by several later layers counts once; model inputs count as produced before layer 0."""
        index = self.layer_index()
        n = len(self.layers)
        # per tensor: producer index and last consumer index, bytes
        spans: dict[tuple[str, str], list[int]] = {}
        for e in self.edges:
            key = (e.src, e.tensor or e.src)
            p = -1 if e.src == INPUT_NODE else index[e.src]
            span = spans.setdefault(key, [p, p, 0])
            span[1] = max(span[1], index[e.dst])
            span[2] = max(span[2], e.bytes)
        return crossing_bytes(spans.values(), n)


def crossing_bytes(spans: Iterable[Sequence[int]], num_layers: int) -> list[int]:
    """`result[i]` = summed bytes of the `(producer, last_consumer, bytes)` spans with
    `producer <= i < last_consumer`, for each cut i in 0..num_layers-2 (producer -1: a model input)."""
    diff = [0] * (num_layers + 1)
    for p, last, nbytes in spans:
        lo = max(p, 0)
        if last > lo:
            diff[lo] += nbytes
            diff[last] -= nbytes
    out, acc = [], 0
    for i in range(num_layers - 1):
        acc += diff[i]
        out.append(acc)
    return out


def digest(model: BaseModel) -> str:
    """sha256 of a model's canonical JSON (sorted keys, no whitespace, optional fields that
    are absent left out: a format gaining an optional field keeps every digest)."""
    return digest_data(model.model_dump(mode="json", exclude_none=True))


def digest_data(data: object) -> str:
    """sha256 of JSON-able data in canonical form (sorted keys, no whitespace)."""
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- cluster.json


MAX_DEVICE_MEMORY_GB = 1e6  # a petabyte per device: beyond it, a typo (and bytes overflow)
MAX_SPEED = 1e6
MIN_SPEED = 1e-6  # a device a million times slower than the profiled one: a typo (speed 1e-300
# priced stages at 1e300 ms, refused only when the plan was written)
MAX_LATENCY_US = 1e7  # ten seconds per message: beyond it, a typo (and predictions of ~1e308 ms)


class NodeSpec(_Closed):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    name: str
    devices: PositiveInt = Field(strict=True)  # "2" or true is a mistake, not a count
    device_memory_gb: float = Field(gt=0, le=MAX_DEVICE_MEMORY_GB)
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)  # relative to the profiled device


@dataclass(frozen=True)
class Device:
    rank: int  # global rank, node-major
    node: int  # index of its node
    node_name: str
    speed: float
    memory_bytes: float


MAX_CLUSTER_DEVICES = 65_536  # a plan's ranks; the service has its own, smaller limit


class Cluster(_Closed):
    """Uniform form (`nodes` an int with `devices_per_node`, `device_memory_gb`) or the list form
    (`nodes` a list of NodeSpec) for mixed hardware. Ranks are numbered node by node."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    nodes: PositiveInt | list[NodeSpec]
    devices_per_node: PositiveInt | None = None
    device_memory_gb: float | None = Field(default=None, gt=0, le=MAX_DEVICE_MEMORY_GB)
    speed: float = Field(default=1.0, ge=MIN_SPEED, le=MAX_SPEED)
    intra_node_gb_per_s: float = Field(gt=0)
    inter_node_gb_per_s: float = Field(gt=0)
    latency_us: NonNegativeFloat = Field(default=0.0, le=MAX_LATENCY_US)
    # per link class, when measured (`python -m runtime calibrate`): a message of n bytes takes
    # `latency_us + n / gb_per_s` (the alpha-beta model); None: `latency_us` for that class
    intra_node_latency_us: NonNegativeFloat | None = Field(default=None, le=MAX_LATENCY_US)
    inter_node_latency_us: NonNegativeFloat | None = Field(default=None, le=MAX_LATENCY_US)
    # what each pipeline message pays beyond its link (the runtime's work and wake-ups around a
    # message): measured by `python -m runtime calibrate` in a short pipeline of its own, fitted
    # from a run by `python -m planner refine`; not paid by all-reduces
    p2p_overhead_us: NonNegativeFloat = Field(default=0.0, le=MAX_LATENCY_US)
    # measured gradient all-reduce time = the ring formula's / allreduce_efficiency (<= 1)
    allreduce_efficiency: float = Field(default=1.0, gt=0, le=1)
    # what calibrate measured, for people (points, fits, per-rank speeds, nominal figures)
    calibration: dict[str, Any] | None = None
    # memory of every device the model cannot use (the framework's own: cuBLAS workspaces);
    # None: the profile's `device.workspace_bytes` (0 for a CPU profile)
    reserved_memory_gb: NonNegativeFloat | None = None

    @model_validator(mode="after")
    def _check_form(self) -> Cluster:
        if isinstance(self.nodes, int):
            missing = [k for k in ("devices_per_node", "device_memory_gb") if getattr(self, k) is None]
            if missing:
                raise ValueError(f"the uniform form (nodes: int) needs {', '.join(missing)}")
        else:
            if not self.nodes:
                raise ValueError("nodes: the list form needs at least one node")
            names = [s.name for s in self.nodes]
            dup = next((n for n in names if names.count(n) > 1), None)
            if dup is not None:
                raise ValueError(f"nodes: the name {dup!r} appears twice; give every node its own name")
            given = [k for k in ("devices_per_node", "device_memory_gb") if getattr(self, k) is not None]
            if given:
                raise ValueError(
                    f"{', '.join(given)}: not allowed with the list form; give each node its own"
                )
        total = (self.nodes * (self.devices_per_node or 0) if isinstance(self.nodes, int)
                 else sum(s.devices for s in self.nodes))
        if total > MAX_CLUSTER_DEVICES:
            raise ValueError(f"{total} devices; pipeplan plans for at most {MAX_CLUSTER_DEVICES} "
                             "(the search's memory grows with the devices): describe a smaller cluster")
        return self

    def with_memory_reserved(self, nbytes: float) -> Cluster:
        """The cluster as the model sees it: every device's memory less `nbytes`."""
        if nbytes <= 0:
            return self
        gb = nbytes / GB
        specs = self.node_specs()
        small = min(s.device_memory_gb for s in specs)
        if small <= gb:
            raise PipeplanError(f"devices of {small:g} GB cannot hold the {gb:.3f} GB the framework "
                             "reserves on each (reserved_memory_gb, or the profile's "
                             "device.workspace_bytes): describe larger devices")
        if isinstance(self.nodes, int):
            return self.model_copy(update={"device_memory_gb": self.device_memory_gb - gb})  # type: ignore[operator]
        return self.model_copy(update={"nodes": [s.model_copy(update={"device_memory_gb": s.device_memory_gb - gb})
                                                 for s in specs]})

    def node_specs(self) -> list[NodeSpec]:
        if isinstance(self.nodes, int):
            assert self.devices_per_node is not None and self.device_memory_gb is not None
            return [
                NodeSpec(name=f"node{i}", devices=self.devices_per_node,
                         device_memory_gb=self.device_memory_gb, speed=self.speed)
                for i in range(self.nodes)
            ]
        return list(self.nodes)

    def devices(self) -> list[Device]:
        out: list[Device] = []
        for n, spec in enumerate(self.node_specs()):
            for _ in range(spec.devices):
                out.append(Device(len(out), n, spec.name, spec.speed, spec.device_memory_gb * GB))
        return out

    @property
    def num_devices(self) -> int:
        return sum(s.devices for s in self.node_specs())


# ---------------------------------------------------------------- plan options and plan.json

ScheduleName = Literal["1f1b", "gpipe", "zb-h1"]
# what a user may ask for: a schedule, or "auto" (the planner chooses one with the partition)
ScheduleRequest = Literal["1f1b", "gpipe", "zb-h1", "auto"]
ObjectiveName = Literal["iteration", "throughput"]


MAX_MICROBATCHES = 100_000  # per iteration: more is a typo (and hours of schedule building)
MAX_TIME_LIMIT_S = 86_400.0


class PlanOptions(_Closed):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    global_batch: PositiveInt = 64
    microbatch_size: PositiveInt | None = None  # None: the profile's batch size
    # a list given is never empty: [] read as "not given" and planned without a word
    microbatch_sizes: list[PositiveInt] | None = Field(default=None, min_length=1)  # cpsat chooses among these
    schedule: ScheduleRequest = "1f1b"
    method: str = "cpsat"
    objective: ObjectiveName = "iteration"
    optimizer: OptimizerName = "adam"
    time_limit_s: float = Field(default=10.0, gt=0, le=MAX_TIME_LIMIT_S)
    powers_of_two: bool = False
    seed: int = Field(default=0, ge=0, le=MAX_INT)  # --seed's range (planner.limits.seed_arg)
    # method "manual": layers per stage, replicas per stage (each stage takes a device at least)
    split: list[PositiveInt] | None = Field(default=None, min_length=1, max_length=MAX_CLUSTER_DEVICES)
    replicas: list[PositiveInt] | None = Field(default=None, min_length=1, max_length=MAX_CLUSTER_DEVICES)
    recompute: list[bool] | None = Field(default=None, min_length=1, max_length=MAX_CLUSTER_DEVICES)  # per stage
    allow_recompute: bool = True  # False (--no-recompute): no stage may recompute
    tp: list[PositiveInt] | None = Field(default=None, min_length=1, max_length=MAX_CLUSTER_DEVICES)  # manual: TP degree per stage
    # the largest tensor-parallel degree the search may give a stage (None: the largest
    # profiled degree that fits in a node; 1: no tensor parallelism)
    max_tp: PositiveInt | None = Field(default=None, le=MAX_CLUSTER_DEVICES)

    @model_validator(mode="after")
    def _check(self) -> PlanOptions:
        sizes = ([self.microbatch_size] if self.microbatch_size else []) + (self.microbatch_sizes or [])
        for mbs in sizes:
            if self.global_batch % mbs:
                raise ValueError(
                    f"global_batch {self.global_batch} is not a multiple of microbatch size {mbs}"
                )
            if self.global_batch // mbs > MAX_MICROBATCHES:
                raise ValueError(
                    f"global_batch {self.global_batch} / microbatch size {mbs} is "
                    f"{self.global_batch // mbs} microbatches per iteration; at most "
                    f"{MAX_MICROBATCHES} are planned: use a larger microbatch size"
                )
        if self.replicas is not None and self.split is not None and len(self.replicas) != len(self.split):
            raise ValueError("replicas: give one count per stage of split")
        if self.recompute is not None and self.split is not None and len(self.recompute) != len(self.split):
            raise ValueError("recompute: give one flag (0 or 1) per stage of split")
        if self.recompute and any(self.recompute) and not self.allow_recompute:
            raise ValueError("recompute asks for recomputation but allow_recompute is false")
        if self.tp is not None and self.split is not None and len(self.tp) != len(self.split):
            raise ValueError("tp: give one degree per stage of split")
        return self


def option_conflicts(o: PlanOptions, name: Callable[[str], str] = lambda f: f,
                     method_matters: bool = True) -> str | None:
    """What a request's options (the command line's, the service's) ask that contradicts itself
    or that its method would ignore; `name` spells a field as the user gave it (`--split` on
    the command line); without `method_matters` (one request solved by several methods) the
    method is not checked. None: nothing. Not a validator of PlanOptions: a plan.json's options
    hold the chosen microbatch size beside the sizes it was chosen from."""
    for field, what in (("replicas", "count"), ("tp", "degree"), ("recompute", "flag (0 or 1)")):
        if getattr(o, field) and not o.split:
            return f"{name(field)} needs {name('split')} (the layers per stage): one {what} per stage"
    if o.microbatch_size and o.microbatch_sizes:
        return (f"{name('microbatch_size')} fixes the size, {name('microbatch_sizes')} lets the planner "
                "choose: give one of them")
    if not method_matters:
        return None
    if o.split and o.method != "manual":
        return f"{name('split')} is for {name('method')} manual, not {o.method}"
    for field in ("microbatch_sizes", "powers_of_two"):
        if getattr(o, field) and o.method != "cpsat":
            return f"{name(field)} is for {name('method')} cpsat (the search), not {o.method}"
    if o.max_tp is not None and o.method != "cpsat":
        return (f"{name('max_tp')} is for {name('method')} cpsat (the search), not {o.method}"
                + (f": give {name('method')} manual its degrees with {name('tp')}" if o.method == "manual" else ""))
    if o.objective != "iteration" and o.method != "cpsat":
        return f"{name('objective')} {o.objective} is for {name('method')} cpsat (the search), not {o.method}"
    return None


class StagePredicted(_Open):
    """What the planner predicts of one stage; the simulator (`planner simulate`, `refine`)
    computes from it, so every figure is checked and none is negative."""

    fwd_ms: NonNegativeFloat  # per microbatch, on this stage's devices
    bwd_ms: NonNegativeFloat
    compute_ms: NonNegativeFloat  # fwd_ms + bwd_ms
    memory_bytes: NonNegativeInt  # peak per device
    memory_limit_bytes: PositiveInt  # a device of 0 bytes is no device (refine divided by it)
    allreduce_ms: NonNegativeFloat = 0.0
    optimizer_ms: NonNegativeFloat = 0.0  # one optimizer step, per iteration, after the all-reduce
    bwd_input_ms: NonNegativeFloat | None = None  # zb-h1: B (recomputation included) and W of bwd_ms
    bwd_weight_ms: NonNegativeFloat | None = None
    # TP all-reduces of one microbatch's forward / backward (a TP stage; inside fwd_ms / bwd_ms)
    tp_comm_fwd_ms: NonNegativeFloat = 0.0
    tp_comm_bwd_ms: NonNegativeFloat = 0.0
    # Beyond these, `build_plan` writes what the simulator needs (`planner.simulator.
    # costs_from_plan`): per device `static_memory_bytes`, `reserved_memory_bytes`; per
    # microbatch `activation_bytes_per_microbatch`, `weight_hold_bytes_per_microbatch`,
    # `transient_bytes`, `loss_transient_bytes`; `peak_inflight`; and `sends`, a list of
    # {to, bytes, ms} to later stages (`Plan` checks each `to`). Extra fields, so a plan
    # without them reads as it did; checked here (`_simulated`), since a hand-edited plan
    # crashed the simulator with IndexError / TypeError / KeyError or was read wrongly.

    @model_validator(mode="after")
    def _simulated(self) -> StagePredicted:
        extra = self.model_extra or {}
        for name in PREDICTED_AMOUNTS:
            value = extra.get(name)
            if value is not None and not _amount(value):
                raise ValueError(f"{name}: {value!r} is not a number of 0 or more")
        sends = extra.get("sends")
        if sends is None:
            return self
        if not isinstance(sends, list):
            raise ValueError(f"sends: {type(sends).__name__}, not a list of {{to, bytes, ms}}")
        for k, snd in enumerate(sends):
            if not (isinstance(snd, dict) and {"to", "bytes", "ms"} <= set(snd)):
                raise ValueError(f"sends[{k}]: {snd!r} is not {{to, bytes, ms}}")
            if not (_amount(snd["to"]) and isinstance(snd["to"], int)):
                raise ValueError(f"sends[{k}].to: {snd['to']!r} is not a stage index")
            for key in ("bytes", "ms"):
                if not _amount(snd[key]):
                    raise ValueError(f"sends[{k}].{key}: {snd[key]!r} is not a number of 0 or more")
        return self


PREDICTED_AMOUNTS = ("static_memory_bytes", "reserved_memory_bytes", "activation_bytes_per_microbatch",
                     "weight_hold_bytes_per_microbatch", "transient_bytes", "loss_transient_bytes",
                     "peak_inflight")


def _amount(value: object) -> bool:
    """A JSON number of 0 or more (not a bool, not NaN or infinite)."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) \
        and value >= 0


class PlanStage(_Open):
    index: NonNegativeInt
    layers: list[str] = Field(min_length=1)
    replicas: PositiveInt
    # replicas x tp ranks, replica-major: replica k's tensor-parallel ranks are
    # devices[k*tp:(k+1)*tp]
    devices: list[NonNegativeInt]
    predicted: StagePredicted
    recompute: bool = False  # activation recomputation (torch.utils.checkpoint per block)
    tp: PositiveInt = 1  # tensor-parallel degree: each replica is sharded over tp devices
    # the profile's parameter bytes of the stage's layers (whole, one replica): the runtime
    # checks the model it builds against it (absent in older plans: not checked)
    param_bytes: NonNegativeInt | None = None
    # of param_bytes, the parameters that take no gradient (requires_grad=False): checked the
    # same way, since they change the stage's memory and optimizer step (absent: not checked)
    frozen_param_bytes: NonNegativeInt | None = None

    @model_validator(mode="after")
    def _check(self) -> PlanStage:
        if len(self.devices) != self.replicas * self.tp:
            raise ValueError(
                f"stage {self.index}: {self.replicas} replicas x tp {self.tp} but "
                f"{len(self.devices)} devices"
            )
        return self

    def replica_ranks(self) -> list[int]:
        """The first rank of each replica (the one the schedule and the simulator track)."""
        return self.devices[::self.tp]


class Predicted(_Open):
    iteration_ms: float
    throughput_samples_per_s: float
    lower_bound_ms: float
    bubble_fraction: float
    ratio_to_lower_bound: float


class SolverInfo(_Open):
    name: str
    status: str  # OPTIMAL | FEASIBLE | HEURISTIC | FALLBACK | ...
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    wall_s: float = 0.0


class ScheduleGenerator(_Open):
    name: ScheduleName
    params: dict[str, int | list[int]] = Field(default_factory=dict)


class Plan(_Open):
    schema_version: SchemaVersion = SCHEMA_VERSION
    profile_sha256: str
    model: ModelRef
    cluster: Cluster
    options: PlanOptions
    schedule: ScheduleName
    global_batch: PositiveInt
    microbatch_size: PositiveInt
    num_microbatches: PositiveInt
    stages: list[PlanStage] = Field(min_length=1)
    predicted: Predicted
    solver: SolverInfo
    # the schedule each rank executes: explicit action strings per rank ("1F3" = stage 1
    # forward of microbatch 3), keyed by global rank as a string; or, for large plans, the
    # generator from which every rank derives exactly the same lists.
    rank_actions: dict[str, list[str]] | None = None
    generator: ScheduleGenerator | None = None

    @model_validator(mode="after")
    def _check(self) -> Plan:
        ranks = [d for s in self.stages for d in s.devices]
        if len(set(ranks)) != len(ranks):
            raise ValueError("a device appears in two stages")
        S = len(self.stages)
        for k, st in enumerate(self.stages):
            if st.index != k:
                raise ValueError(f"stages[{k}] has index {st.index}: stages are listed in order, "
                                 "indexed 0, 1, 2, ...")
            for snd in getattr(st.predicted, "sends", None) or ():
                if not k < snd["to"] < S:
                    later = f"stages {k + 1} to {S - 1}" if k + 1 < S - 1 else \
                        f"stage {k + 1}" if k + 1 == S - 1 else "none: it is the last stage"
                    raise ValueError(f"stage {k} sends to stage {snd['to']}: a stage sends only to "
                                     f"later ones ({later})")
        if self.microbatch_size * self.num_microbatches != self.global_batch:
            raise ValueError("microbatch_size x num_microbatches must equal global_batch")
        if self.num_microbatches > MAX_MICROBATCHES:  # as plan makes them: 10**6 took 100 s and 2.8 GB
            raise ValueError(f"{self.num_microbatches} microbatches per iteration; at most "
                             f"{MAX_MICROBATCHES} are planned, simulated or run: make the plan "
                             "again with a larger microbatch size")
        if self.rank_actions is None and self.generator is None:
            raise ValueError("a plan needs rank_actions or a schedule generator")
        return self

    @property
    def world_size(self) -> int:
        return sum(len(s.devices) for s in self.stages)


# ---------------------------------------------------------------- report.json (runtime)


class RankReport(_OpenFinite):
    # times and bytes a run measured: never negative, never Infinity / NaN (`refine` fits
    # corrections to them, so a hand-edited report is checked before anything is written)
    rank: NonNegativeInt
    stage: NonNegativeInt
    replica: NonNegativeInt
    fwd_ms_per_microbatch: NonNegativeFloat
    bwd_ms_per_microbatch: NonNegativeFloat
    comm_ms: NonNegativeFloat  # per iteration
    idle_ms: NonNegativeFloat  # per iteration
    peak_memory_bytes: NonNegativeInt
    peak_inflight_microbatches: NonNegativeInt
    schedule_peak_inflight: NonNegativeInt | None = None
    memory_measure: str | None = None
    peak_activation_bytes: NonNegativeInt | None = None
    predicted_memory_bytes: NonNegativeInt | None = None
    optimizer_ms: NonNegativeFloat | None = None  # one optimizer step, per iteration
    predicted_optimizer_ms: NonNegativeFloat | None = None


class Report(_OpenFinite):
    schema_version: SchemaVersion = SCHEMA_VERSION
    plan_profile_sha256: str
    steps: PositiveInt
    iteration_ms: PositiveFloat  # median over measured steps
    samples_per_s: NonNegativeFloat
    predicted_iteration_ms: NonNegativeFloat
    losses: list[float | None]  # None: that step's loss was not finite (a run that diverged)
    ranks: list[RankReport]
    optimizer: OptimizerName | None = None  # the run's (None: older reports)
