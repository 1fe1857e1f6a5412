"""Build the pipeline stages of a plan from a user's model, with the profiler's tracing code.

Internal module. Every rank builds the full model (same seed, so the same weights), traces it,
builds a `StageModule` for every stage of the plan to learn which tensor keys each stage reads
and writes (the routing: who sends what to whom), keeps its own stage and drops the rest.
Parameters tied across stages (one `nn.Parameter` under several names held by different
stages) are found here as well, so their gradients can be summed between those stages.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from planner.errors import PipeplanError
from planner.formats import INPUT_NODE, Plan
from profiler.graph import OUTPUT_KEY  # noqa: F401 - re-exported for the executor

INPUT_PREFIX = f"{INPUT_NODE}:"  # profiler.graph.input_key(i) == INPUT_PREFIX + str(i)


@dataclass
class Routing:
    """Which stage produces each tensor key and which stages consume it."""

    input_keys: list[list[str]]  # per stage
    output_keys: list[list[str]]  # per stage
    producer: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def from_keys(cls, input_keys: list[list[str]], output_keys: list[list[str]]) -> Routing:
        r = cls([list(k) for k in input_keys], [list(k) for k in output_keys])
        for s, keys in enumerate(output_keys):
            for k in keys:
                if k in input_keys[s] or k.startswith(INPUT_PREFIX):
                    continue  # passed through: the original producer sends it straight on
                r.producer.setdefault(k, s)
        for s, keys in enumerate(input_keys):
            for k in keys:
                if k.startswith(INPUT_PREFIX):
                    continue
                if k not in r.producer:
                    raise PipeplanError(
                        f"stage {s} reads tensor {k!r} that no earlier stage produces; "
                        "the plan's stages do not fit this model (re-profile and re-plan)"
                    )
                if r.producer[k] >= s:
                    raise PipeplanError(f"stage {s} reads {k!r} produced by a later stage {r.producer[k]}")
                r.consumers.setdefault(k, []).append(s)
        return r

    def keys(self) -> list[str]:
        """Every key, in one order all ranks agree on."""
        out = sorted({k for ks in self.input_keys + self.output_keys for k in ks})
        return out + ["<loss>"]

    def sends(self, stage: int) -> list[tuple[str, list[int]]]:
        """(key, consumer stages) for every tensor this stage sends forward."""
        return [(k, self.consumers[k]) for k in self.output_keys[stage]
                if self.producer.get(k) == stage and k in self.consumers]

    def recvs(self, stage: int) -> list[tuple[str, int]]:
        """(key, producer stage) for every tensor this stage receives."""
        return [(k, self.producer[k]) for k in self.input_keys[stage] if not k.startswith(INPUT_PREFIX)]


def layer_names(graph: object) -> list[str]:
    return list(graph.layer_names())  # type: ignore[attr-defined]


# LayerGraph.is_tensor, .mutations, .method ("fx" or "export"; None in a record without it)
TraceInfo = tuple[dict[str, bool], dict[str, list[str]], str | None]


def trace_model(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], granularity: str,
                tensor_kinds: dict[str, bool] | TraceInfo | None = None) -> object:
    """The profiler's layer graph (tracing leaves the model's buffers as they were; with
    `tensor_kinds` from the launcher's trace it runs no user code): which traced values are
    tensors, or that and which nodes modify a tensor in place (`load_trace_info`)."""
    from profiler.graph import trace

    # (a record of two: is_tensor and mutations, as written before the method was kept)
    kinds, mutations, method = (*tensor_kinds, None)[:3] if isinstance(tensor_kinds, tuple) else \
        (tensor_kinds, None, None)
    return trace(model, example_inputs, granularity=granularity, tensor_kinds=kinds,
                 mutations=mutations, method=method)


def save_trace_info(graph: object, granularity: str, path: str | Path) -> None:
    """What a rank needs to trace without running the model (see `load_trace_info`)."""
    Path(path).write_text(json.dumps({"granularity": granularity,
                                      "is_tensor": graph.is_tensor,  # type: ignore[attr-defined]
                                      "mutations": graph.mutations,  # type: ignore[attr-defined]
                                      "method": graph.method}))  # type: ignore[attr-defined]


def load_trace_info(path: str | None, granularity: str | None) -> TraceInfo | None:
    """The launcher's record of which traced values are tensors and which nodes modify a
    tensor in place, if it was made at this granularity (else None: the rank records it)."""
    if not path or not Path(path).is_file():
        return None
    data = json.loads(Path(path).read_text())
    if data.get("granularity") != granularity:
        return None
    return data["is_tensor"], data.get("mutations", {}), data.get("method")


def trace_for_plan(model: nn.Module, example_inputs: tuple[torch.Tensor, ...], plan: Plan,
                   model_path: str, granularity: str | None,
                   tensor_kinds: dict[str, bool] | TraceInfo | None = None) -> tuple[object, str]:
    """Trace at `granularity`, or (None) at the first of the profiler's granularities whose
    layers are the plan's; checks the plan's layer names against the model."""
    tried = [granularity] if granularity else ["blocks", "modules"]
    planned = [n for s in plan.stages for n in s.layers]
    if not granularity and any("+" in n for n in planned[1:]):
        # a profile made with --split-points: its layers start at these modules
        tried.append("split:" + ",".join(n.split("+")[0] for n in planned[1:]))
    graph = None
    for g in tried:
        with warnings.catch_warnings(record=True) as said:  # only the chosen tracing's count
            warnings.simplefilter("always")
            try:
                candidate = trace_model(model, example_inputs, g, tensor_kinds if g == granularity else None)
            except PipeplanError:
                if g != tried[-1] or graph is None:
                    raise
                break  # split points guessed from the layer names that do not fit this model
        graph = candidate
        names = layer_names(graph)
        if planned == names:
            for w in said:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            return graph, g
    assert graph is not None
    check_layers(plan, layer_names(graph), model_path, tried[-1])
    return graph, tried[-1]


def check_layers(plan: Plan, names: list[str], model_path: str, granularity: str = "blocks") -> None:
    known = set(names)
    missing = [n for s in plan.stages for n in s.layers if n not in known]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (" …" if len(missing) > 5 else "")
        raise PipeplanError(
            f"the plan names layers that {model_path} does not have: {shown} "
            f"(traced at granularity {granularity!r} it has {len(names)} layers, e.g. "
            f"{', '.join(names[:3])}); profile this model again and make a new plan, or pass "
            "the --granularity it was profiled with"
        )
    planned = [n for s in plan.stages for n in s.layers]
    if planned != names:
        k = next((i for i, (a, b) in enumerate(zip(planned, names, strict=False)) if a != b),
                 min(len(planned), len(names)))
        where = (f"its layer {k} is {planned[k]!r} where the model's is {names[k]!r}"
                 if k < min(len(planned), len(names)) else
                 f"it lacks the model's layer {names[k]!r}" if k < len(names) else
                 f"it has {planned[k]!r} past the model's last layer")
        seen: set[str] = set()
        twice = next((n for n in planned if n in seen or seen.add(n)), None)
        if twice is not None:
            where = f"it names layer {twice!r} twice"
        raise PipeplanError(
            f"the plan's stages cover {len(planned)} layers but {model_path} traces into "
            f"{len(names)} layers in a different order or number ({where}): if the plan was "
            "edited by hand, make it again with plan --method manual --split ...; else the model "
            "changed since it was profiled: profile it again and re-plan"
        )


def parameter_mismatch(plan: Plan, graph: object, built: list[nn.Module], model_path: str) -> str | None:
    """Where a stage's layers, built now, hold other parameter bytes than the profile said
    (`PlanStage.param_bytes`: a tensor two of them hold counted once; older plans counted it
    per layer, as the profiler does, and are checked that way): a message naming the
    first such stage, else None. The file's hash and layer names can match while the model
    differs: a model file sized by environment variables or other files (a width, a dtype).
    Plans without the figure, and lazy modules not yet materialised, are not checked.
    `built`: the plan's stages (`build_all_stages`)."""
    from profiler.graph import build_stage
    from profiler.measure import frozen_param_bytes, param_bytes

    for st, stage in zip(plan.stages, built, strict=True):
        if st.param_bytes is None:
            continue
        try:
            held, frozen = param_bytes(stage), frozen_param_bytes(stage)  # a tensor two layers hold, once
            # plans made before tied tensors were counted once per stage counted them per layer
            layers = [build_stage(graph, [name]) for name in st.layers] if held != st.param_bytes else []
            per_layer = sum(param_bytes(m) for m in layers)
        except ValueError:  # an UninitializedParameter has no size yet
            return None
        where = f"the layers of stage {st.index} ({st.layers[0]} … {st.layers[-1]})"
        if layers and per_layer == st.param_bytes:
            held, frozen = per_layer, sum(frozen_param_bytes(m) for m in layers)
        if held != st.param_bytes:
            return (f"{model_path} builds a different model than was profiled: {where} hold "
                    f"{held:,} bytes of parameters, the profile {st.param_bytes:,} (its size set "
                    "by environment variables or other files, e.g. a width or a dtype?)")
        if st.frozen_param_bytes is not None and frozen != st.frozen_param_bytes:
            return (f"{model_path} builds a different model than was profiled: {where} hold "
                    f"{frozen:,} bytes of frozen parameters (requires_grad=False), the profile "
                    f"{st.frozen_param_bytes:,}: parameters were frozen or unfrozen since, which "
                    "changes the stage's gradients, optimizer state and memory")
    return None


SEND_RATIO = 4.0  # the tensors a stage sends, traced now against the plan's price: beyond it, another model
SEND_SLACK = 65536  # bytes: small tensors (masks, positions) may differ in how they are counted


def activation_mismatch(plan: Plan, graph: object, built: list[nn.Module], model_path: str) -> str | None:
    """Where the tensors a stage sends to another, traced now on one microbatch, take more than
    SEND_RATIO times the bytes the plan priced for them, or less than 1 / SEND_RATIO (times the
    ratio of the profiled batch to the microbatch, either way): a message, else None. Names, hash and parameters can match while the inputs differ (a sequence length
    set by an environment variable: a plan made at 8 tokens ran at 4096, its peaks 1.6x the
    devices' memory and its iteration 7.8x the prediction, unwarned; an outside review). Plans
    without their sends, and graphs traced without sizes (a rank's), are not checked. `built`:
    the plan's stages (`build_all_stages`)."""
    sizes = {t.id: t.bytes for t in getattr(graph, "tensors", {}).values()}
    profiled = (plan.model_extra or {}).get("profile_batch_size")
    if not any(sizes.values()) or not isinstance(profiled, int) or profiled <= 0:
        return None  # (plans made before the profile's batch was written: not checked)
    # a tensor that does not grow with the batch (a position bias of (heads, S, S) sent on) is
    # priced at microbatch / profiled batch of its bytes: that far off is not a mismatch
    b = plan.microbatch_size
    ratio = SEND_RATIO * max(profiled / b, b / profiled)
    routing = routing_of(built)
    for st in plan.stages:
        planned = {int(x["to"]): float(x["bytes"]) for x in (st.predicted.model_extra or {}).get("sends") or []}
        now: dict[int, int] = {}
        for key, dsts in routing.sends(st.index):
            for t in dsts:
                now[t] = now.get(t, 0) + sizes.get(key, 0)
        for t, priced in sorted(planned.items()):
            got = now.get(t, 0)
            if got > ratio * priced + SEND_SLACK or priced > ratio * got + SEND_SLACK:
                return (f"{model_path} runs on other input sizes than were profiled: what stage "
                        f"{st.index} sends stage {t} takes {got:,} bytes per microbatch of "
                        f"{plan.microbatch_size} now, the plan {priced:,.0f} (make_batch's shapes "
                        "set by environment variables or other files, e.g. a sequence length?); "
                        "its memory and times are not this model's")
    return None


def build_all_stages(graph: object, plan: Plan) -> list[nn.Module]:
    from profiler.graph import build_stage

    return [build_stage(graph, list(s.layers)) for s in plan.stages]


def routing_of(stages: list[nn.Module]) -> Routing:
    return Routing.from_keys([list(m.input_keys) for m in stages],  # type: ignore[arg-type]
                             [list(m.output_keys) for m in stages])  # type: ignore[arg-type]


def named_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers of a stage under the original model's names (its state_dict keys)."""
    return dict(module.state_dict(keep_vars=True))


def stage_parameters(module: nn.Module) -> dict[str, nn.Parameter]:
    """Trainable parameters of a stage by original name; a parameter tied within the stage is
    listed under every name it has (same object)."""
    return {k: v for k, v in named_tensors(module).items() if isinstance(v, nn.Parameter)}


def tie_sets(model: nn.Module) -> list[list[str]]:
    """State-dict keys of each tensor (parameter or buffer) the model holds under several names."""
    by_id: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def parameter_name_sets(model: nn.Module) -> list[list[str]]:
    """The names of each parameter of the model, one list per parameter (several where it is
    tied): what `cross_stage_ties` looks for in the stages."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return list(by_id.values())


def complete_aliases(state: dict[str, object], ties: list[list[str]]) -> dict[str, object]:
    """Add every other name of a tied tensor (a stage holds it under one name)."""
    out = dict(state)
    for names in ties:
        have = [k for k in names if k in out]
        for k in names:
            if have:
                out.setdefault(k, out[have[0]])
    return out


def cross_stage_ties(ties: list[list[str]], stage_names: list[set[str]]) -> list[tuple[list[str], list[int]]]:
    """(names, stages holding it) for every tied parameter held by more than one stage."""
    out = []
    for names in ties:
        holders = [s for s, have in enumerate(stage_names) if have & set(names)]
        if len(holders) > 1:
            out.append((names, holders))
    return out
