"""Activation recomputation of a stage: each of its blocks (the plan's layers) under
`torch.utils.checkpoint` (non-reentrant), so a microbatch in flight keeps only the blocks'
inputs and the backward runs each block's forward once more.

Internal module. The blocks are built from the same traced graph as the stage and share its
parameters and buffers (the same tensor objects: the optimizer, the all-reduce and the
checkpoint files see the stage module as before); hooks and custom autograd Functions run as
written, and checkpoint's saved random state makes the recomputed forward draw the same
random numbers from torch as the first; Python's and numpy's global generators are put back
the same way (a recomputed forward drawing from them drew other numbers).

A block's forward may also read state its forwards change: buffers changed in place (a step
counter, running statistics) and plain Python attributes (`self.n += 1`). By the time the
backward recomputes microbatch i, the forwards of the microbatches after it have moved that
state. So each forward keeps what it found (`profiler.module_state.BlockState`: attributes by
reference, plain values and containers of them, a block's own generators, copies of the
tensors a forward changes in place), the recomputation runs on it, and then the block's state
is put back as the recomputation found it: the
recomputed forward computes what the first one did, and the state moves once per
microbatch, as in training without recomputation.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.errors import PipeplanError
from profiler.measure import _storage_key
from profiler.module_state import BlockState, Snapshot
from profiler.tracing import python_rng_states, set_python_rng_states

Values = dict[str, torch.Tensor]


def block_modules(graph: object, layers: list[str]) -> list[nn.Module]:
    """One module per layer, in order, each `forward(values) -> values` like a stage's."""
    from profiler.graph import build_stage

    return [build_stage(graph, [name]) for name in layers]  # type: ignore[arg-type]


def check_shared(stage: nn.Module, blocks: list[nn.Module]) -> None:
    own = {id(t) for t in stage.state_dict(keep_vars=True).values()}
    for b in blocks:
        for name, t in b.state_dict(keep_vars=True).items():
            if id(t) not in own:
                raise PipeplanError(f"recomputation: block tensor {name!r} is not the stage's own "
                                    "(plan this stage without recompute)")


def _counting_hooks(on_saved: Callable[[torch.Tensor], None]) -> AbstractContextManager[object]:
    """Saved-tensor hooks that report each tensor to `on_saved` and then hand it to the hooks
    active now (checkpoint's own, during a recomputation), so checkpoint works as before."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return nullcontext()
    pack, unpack = top

    def counting_pack(t: torch.Tensor) -> object:
        on_saved(t)
        return pack(t)

    return torch.autograd.graph.saved_tensors_hooks(counting_pack, unpack)


class _Held:
    """A value passed through torch.utils.checkpoint as one opaque argument."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


def recomputed_forward(stage: nn.Module, blocks: list[nn.Module]) -> Callable[[Values], Values]:
    """The stage's forward with each block checkpointed.

    The returned function has two attributes for the runtime's memory report: `kept` (after a
    forward: storage -> bytes of what the checkpoints keep, the blocks' inputs) and
    `on_recompute` (settable: called during a backward's recomputation of a block with the
    storages, pointer -> bytes, the recomputed forward has saved so far; they stay alive until
    that block's backward has used them)."""
    check_shared(stage, blocks)
    outputs = list(stage.output_keys)  # type: ignore[attr-defined]
    states = {id(b): BlockState(b) for b in blocks}

    def run_block(block: nn.Module, values: Values, found: Snapshot | None,
                  held: _Held | None = None, pristine: Values | None = None) -> Values:
        drawn = held.value if held is not None else None
        state = states[id(block)]
        if torch._C._current_graph_task_id() == -1 or found is None:  # not a recomputation
            out = block(values)
            if found is not None:
                state.learn(found)
            return out
        if pristine:  # the inputs it changed in place, as the first forward found them
            values = {**values, **pristine}
        # a recomputation: it runs on the state the forward found, and then the state is put
        # back as it is now (its forward and the later microbatches' have moved it already);
        # so do Python's and numpy's global generators (checkpoint restores torch's only)
        now = state.capture(every=True)
        state.restore(found, stand_in=True)  # (frozen parameters: stand-ins, `BlockState.restore`)
        drawn_now = python_rng_states() if drawn is not None else None
        if drawn is not None:
            set_python_rng_states(drawn)
        try:
            report = forward.on_recompute  # type: ignore[attr-defined]
            if report is None:
                return block(values)
            saved: dict[int, int] = {}

            def on_saved(t: torch.Tensor) -> None:
                ptr, nbytes = _storage_key(t)
                if ptr not in saved:
                    saved[ptr] = nbytes
                    report(saved)

            with _counting_hooks(on_saved):
                return block(values)
        finally:
            state.restore(now)
            if drawn_now is not None:
                set_python_rng_states(drawn_now)

    def forward(feed: Values) -> Values:
        env = dict(feed)
        kept: dict[int, int] = {}  # what the checkpoints keep: the blocks' inputs, each storage once
        for block in blocks:
            args = {k: env[k] for k in block.input_keys}  # type: ignore[attr-defined]
            found = states[id(block)].capture() if torch.is_grad_enabled() else None
            drawn = python_rng_states() if found is not None else None
            # an input the block changes in place (a model that normalises its input with
            # `x.sub_(...)`) is changed by the time the backward recomputes the block: the
            # recomputation runs on a copy made before (a clone, so its gradient path is the
            # input's), kept until then; the first forward changes the input itself, as the
            # layers after it that read it expect
            pristine = {k: args[k].clone() for k in getattr(block, "mutated_inputs", ())
                        if isinstance(args.get(k), torch.Tensor)} if found is not None else None
            if found is not None:  # (with grad only)
                for t in [*args.values(), *(pristine or {}).values()]:
                    if isinstance(t, torch.Tensor):
                        st = t.untyped_storage()
                        kept.setdefault(st.data_ptr(), st.nbytes())
            # the generators' states in a holder checkpoint does not look into: as an argument,
            # Python's and numpy's 632 numbers were walked for tensors at every call (2 ms of a
            # block's forward priced at 0.06; an outside review)
            held = _Held(drawn) if drawn is not None else None
            env.update(checkpoint(run_block, block, args, found, held, pristine, use_reentrant=False))
        forward.kept = kept  # type: ignore[attr-defined]
        return {k: env[k] for k in outputs}

    forward.kept = {}  # type: ignore[attr-defined]
    forward.on_recompute = None  # type: ignore[attr-defined]
    return forward
