"""Execute one rank's action list for one training step (forward/backward of its microbatches).

Internal module. `F(s, j)` gathers the stage's inputs for microbatch j (model inputs sliced
locally, other tensors received from the stage that produced them), runs the stage and sends
its outputs straight to every later stage that reads them; on the last stage it computes
`loss_fn(output, target_j) / m`, so the gradients summed over microbatches are those of the
mean loss. `B(s, j)` receives the gradients of the outputs (summed over consumers), runs
autograd and sends the inputs' gradients back to their producers. Gradients accumulate in the
parameters' `.grad` until the flush. Where the rank's actions include `W(s, j)` (zero-bubble
schedules), `B(s, j)` computes only the inputs' gradients (graph retained) and `W(s, j)` the
weights' (runtime.split_backward), two separate autograd calls.

Bookkeeping for the report: compute time of each forward and backward, the number of
microbatches in flight (forward done, backward not) and the bytes autograd holds for them: what
each forward saved, until its backward (until its W where the backward is split, plus the
gradients B leaves for W: those of the stage's outputs and of the intermediates where weights
join); on a recomputed stage, also what the recomputation of a block saves, while a backward
(B or W) runs it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from planner.actions import Action
from planner.errors import PipeplanError, first_line
from profiler.measure import INPLACE_ON_LEAF, _storage_key, count_saved_bytes, loss_workspace_bytes
from profiler.module_state import fingerprint, same
from runtime import later_forward
from runtime.comm import P2P
from runtime.stages import INPUT_PREFIX, OUTPUT_KEY, Routing

# steps whose first forward compares the values of the parameters other ranks keep copies of
# (`Executor.watched`): a change through `.data` moves no version
VALUE_CHECK_STEPS = 3


# gloo: receives are posted this many actions ahead. One ahead, posting a receive whose message
# the peer had already sent blocked dist.irecv 1.4-5.5 ms (gloo's connection lock; ~0.05 ms of
# CPU) 10-40 times in 20 steps of the GPT example on 2 stages; two ahead, 0-2 times in 30, and
# the 3 + 3 split's iteration 0.90x (benchmarks/README.md, "gloo_stalls.py"). More costs
# memory and bought nothing more: each posted receive holds a buffer (one activation or
# gradient), which neither the planner's memory model nor the CPU report counts.
# PIPEPLAN_RECV_LOOKAHEAD overrides it on gloo (benchmarks/gloo_stalls.py compares 1 and 2).
# (On NCCL the batched protocol is the only one: `runtime.comm.batched_protocol`.)
def recv_lookahead(device: torch.device) -> int:
    """Actions whose receives are posted ahead: PIPEPLAN_RECV_LOOKAHEAD (2) on gloo, 1 on CUDA."""
    if device.type == "cuda":
        return 1
    text = os.environ.get("PIPEPLAN_RECV_LOOKAHEAD", "2")
    if not text.isdigit() or int(text) < 1:
        raise PipeplanError(f"PIPEPLAN_RECV_LOOKAHEAD={text!r}: give a whole number of actions, 1 or more")
    return int(text)


def drive(actions: Sequence[Action], p2p: P2P, lookahead: int, post: Callable[[Action], None],
          act: Callable[[Action], float]) -> float:
    """Run `actions` with `act` in the order the rank issues its messages: unbatched (gloo),
    each action's receives and the next `lookahead` actions' are posted before it runs;
    batched (NCCL, `planner.p2p_order`'s order), the first action's receives first, then after
    each action its sends and the next action's receives go out as one batch. `post(a)` posts
    action a's receives. Returns the sum of what `act` returns."""
    total = 0.0
    batched = p2p.batched
    for i, a in enumerate(actions):
        if not batched or i == 0:
            post(a)
        if not batched:
            for ahead in actions[i + 1:i + 1 + lookahead]:
                post(ahead)
        total += act(a)
        if batched:  # this action's sends and the next action's receives, one batch
            if i + 1 < len(actions):
                post(actions[i + 1])
            p2p.end_action()
    return total


def checked_loss(loss: object) -> torch.Tensor:
    """`loss_fn`'s value, checked to be what backward starts from: one tensor of one element
    (a float or a vector failed deep inside the executor)."""
    if not isinstance(loss, torch.Tensor):
        raise PipeplanError(f"loss_fn returned a {type(loss).__name__}; it must return the loss as a "
                            "tensor of one element (the mean over the microbatch), computed from the "
                            "model's output so that it has a gradient")
    if loss.numel() != 1:
        raise PipeplanError(f"loss_fn returned a tensor of shape {tuple(loss.shape)}; it must return "
                            "one element (reduce it: .mean() or .sum())")
    return loss


@dataclass
class TimedEvent:
    name: str
    kind: str  # "F" | "B" | "allreduce"
    stage: int
    mb: int
    start_s: float  # time.time()
    end_s: float


@dataclass
class Stats:
    fwd_ms: list[float] = field(default_factory=list)
    bwd_ms: list[float] = field(default_factory=list)
    peak_inflight: int = 0
    peak_saved_bytes: int = 0


@dataclass
class _InFlight:
    received: dict[str, torch.Tensor]  # float inputs from other stages (requires grad)
    outputs: dict[str, torch.Tensor]
    loss: torch.Tensor | None
    saved_bytes: int
    saved_ptrs: set[int] = field(default_factory=set)  # the storages counted in saved_bytes
    pending: object = None  # split_backward.PendingWeights between B and W
    # the stage's state's version counters after this forward (`later_forward.state_versions`),
    # and how many forwards this rank ran before it
    versions: list[int] = field(default_factory=list)
    forward_no: int = 0
    saved_state: set[int] = field(default_factory=set)  # storages of the state autograd saved
    saved_prints: dict[int, tuple[float, ...]] = field(default_factory=dict)  # (`later_forward`)


class StageExecutor:
    """Runs the actions of one rank (one replica of one stage)."""

    def __init__(self, module: nn.Module, stage: int, routing: Routing,
                 stage_devices: Sequence[Sequence[int]], p2p: P2P,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 num_microbatches: int, device: torch.device) -> None:
        self.module = module
        self.stage = stage
        self.routing = routing
        self.stage_devices = stage_devices
        self.p2p = p2p
        self.loss_fn = loss_fn
        self.m = num_microbatches
        self.device = device
        self.is_last = OUTPUT_KEY in routing.output_keys[stage]
        self._sends = routing.sends(stage)
        # the last stage does not hold the model's output from F to B (a language model's
        # logits): the loss's graph keeps what its backward needs, unless another stage takes it
        self._drop_output = self.is_last and all(key != OUTPUT_KEY for key, _ in self._sends)
        self._recvs = routing.recvs(stage)
        self._state = list(module.parameters()) + list(module.buffers())
        self.stats = Stats()
        self.events: list[TimedEvent] = []
        self._inflight: dict[int, _InFlight] = {}
        self._saved_now = 0
        # the loss's backward working memory, measured once on CPU (`profiler.measure.
        # loss_workspace_bytes`); on CUDA the allocator's peak sees it. None: not measured yet
        self.loss_workspace_bytes: int | None = None if device.type != "cuda" else 0
        self._sent_needs_grad: dict[str, bool] = {}  # per key sent on: `forward`
        self.split_backward = False  # set by run() when the actions include W
        # count what autograd saves (a Python hook per saved tensor, ~10 % of a small stage's
        # forward on CPU): the worker turns it on for a run's first step only, whose actions and
        # shapes every later step repeats, so later steps run as the profile timed them
        self.count_memory = True
        # receives posted ahead on gloo; one on CUDA (an unbatched NCCL run matches by order)
        self.recv_lookahead = recv_lookahead(device)
        self._w_done = 0
        self.recompute = False  # the worker sets both for a recomputed stage (runtime.recompute)
        self.forward_fn: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] = module
        self._weights = [p for p in module.parameters() if p.requires_grad]
        self._state_ptrs = {_storage_key(t)[0] for t in self._state}
        self._named_state = later_forward.named_state(module)
        self._named_ptrs = later_forward.storage_ptrs(self._named_state)
        self._forwards = 0  # forwards run, to tell whether a later one ran before a backward
        self._current: _InFlight | None = None  # the microbatch whose backward runs now
        # tensor parallelism: stage s's replica k is ranks stage_devices[s][k*t:(k+1)*t]
        # (t = stage_tp[s]); this rank is rank `tp_rank` of its replica's TP group
        self.stage_tp: Sequence[int] = [1] * len(stage_devices)
        self.tp_rank = 0
        # parameters of which other ranks train copies kept equal by summed gradients (tied
        # across stages, or of a replicated stage), with why and what to do: a forward that
        # changes one in place (nn.Embedding(max_norm=...) renormalises the rows it reads)
        # would part the copies
        self.watched: list[tuple[nn.Parameter, str, str]] = []
        # a change through `.data` moves no version (Glow's ActNorm sets its weights from the
        # first batch that way): the first forward of each of the first VALUE_CHECK_STEPS steps
        # also compares the watched parameters' values (`profiler.module_state.fingerprint`)
        self.value_check_steps = VALUE_CHECK_STEPS
        self._check_values = False

    def forget_backwards(self, n: int) -> None:
        """The first `n` entries of `stats.bwd_ms` were let go (`runtime.report.trim_timings`, at
        the end of a step): the W's to come add to entries `n` places earlier."""
        self._w_done = max(self._w_done - n, 0)

    def _sync(self) -> None:
        """On CUDA, wait for the kernels so compute times are measured, not just launched."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def rank_of(self, stage: int, mb: int) -> int:
        return self.replica_ranks(stage, mb)[0]

    def replica_ranks(self, stage: int, mb: int) -> Sequence[int]:
        """The TP ranks of the replica of `stage` that runs microbatch `mb`."""
        devs, t = self.stage_devices[stage], self.stage_tp[stage]
        k = mb % (len(devs) // t)
        return devs[k * t:(k + 1) * t]

    def peer_in(self, stage: int, mb: int) -> int:
        """The rank of `stage` this rank receives from (activations from a producer, gradients
        from a consumer): TP rank u of a replica receives from TP rank u mod t there."""
        ranks = self.replica_ranks(stage, mb)
        return ranks[self.tp_rank % len(ranks)]

    def peers_out(self, stage: int, mb: int) -> list[int]:
        """The ranks of `stage` this rank sends to: those whose `peer_in` is this rank."""
        ranks, mine = self.replica_ranks(stage, mb), self.stage_tp[self.stage]
        return [r for u, r in enumerate(ranks) if u % mine == self.tp_rank]

    # ------------------------------------------------------------------ receives
    def _post(self, action: Action) -> None:
        """Post this action's receives early where the shapes are known (W receives nothing:
        its B took the gradient)."""
        j = action.mb
        if action.kind == "W":
            return
        if action.kind == "F":
            for key, src in self._recvs:
                self.p2p.post_recv(self.peer_in(src, j), j, key, grad=False)
        else:
            for key, dsts in self._sends:
                for t in dsts:
                    self.p2p.post_recv(self.peer_in(t, j), j, key, grad=True)

    # ------------------------------------------------------------------ one step
    def run(self, actions: Sequence[Action], inputs: Sequence[Sequence[torch.Tensor]],
            targets: Sequence[torch.Tensor]) -> float:
        """Execute `actions`; `inputs[j]`, `targets[j]` are microbatch j's. Returns the sum of
        this rank's scaled microbatch losses (0 on other stages than the last)."""
        self.split_backward = any(a.kind == "W" for a in actions)
        self._check_values = self.value_check_steps > 0 and bool(self.watched)
        self.value_check_steps -= 1

        def act(a: Action) -> float:
            if a.kind == "F":
                return self.forward(a.mb, inputs[a.mb], targets[a.mb])
            if a.kind == "B":
                self.backward(a.mb)
            else:
                self.backward_weight(a.mb)
            return 0.0

        total = drive(actions, self.p2p, self.recv_lookahead, self._post, act)
        if self._inflight:
            raise RuntimeError(f"microbatches {sorted(self._inflight)} have a forward but no backward")
        return total

    def forward(self, j: int, inputs: Sequence[torch.Tensor], target: torch.Tensor) -> float:
        feed: dict[str, torch.Tensor] = {}
        received: dict[str, torch.Tensor] = {}
        for key in self.routing.input_keys[self.stage]:
            if key.startswith(INPUT_PREFIX):
                feed[key] = inputs[int(key[len(INPUT_PREFIX):])].to(self.device)
        for key, src in self._recvs:
            peer = self.peer_in(src, j)
            t = self.p2p.recv(peer, j, key, grad=False)
            assert t is not None
            # a gradient only for what needs one where it was made (an activation, not a frozen
            # feature extractor's output under no_grad, which the user's code may call .numpy() on)
            if t.is_floating_point() and self.p2p.needs_grad(peer, key):
                t.requires_grad_(True)
                received[key] = t
            feed[key] = t
        t0 = time.time()
        # saved activations, each storage once, parameters and buffers not (as the profiler counts)
        saved_state: set[int] = set()
        counting = count_saved_bytes(self._state, saved_state) if self.count_memory else nullcontext({})
        versions = [p._version for p, _, _ in self.watched]
        prints = [fingerprint(p, sample=True) for p, _, _ in self.watched] if self._check_values else None
        with counting as seen:
            try:
                out = self.forward_fn(feed)
            except RuntimeError as exc:
                if INPLACE_ON_LEAF not in str(exc) or not received:
                    raise
                raise PipeplanError(
                    f"stage {self.stage} modifies a tensor it receives ({', '.join(map(repr, received))}) "
                    "in place, e.g. nn.ReLU(inplace=True) or x.add_(...) at the start of its first "
                    "layer: autograd forbids that on a received tensor. Cut the model elsewhere "
                    "(plan --method manual --split ...) or make that operation out of place") from None
            for k, ((p, name, why), version) in enumerate(zip(self.watched, versions, strict=True)):
                if p._version != version or (prints is not None and not same(fingerprint(p, sample=True), prints[k])):
                    raise PipeplanError(
                        f"stage {self.stage}'s forward changes parameter {name!r} in place (as "
                        "nn.Embedding(max_norm=...) renormalises the rows it reads, or a "
                        f"data-dependent initialisation through .data), and {why}")
            self._check_values = False
            if self.count_memory:  # recomputed blocks' inputs
                for ptr, nbytes in getattr(self.forward_fn, "kept", {}).items():
                    seen.setdefault(ptr, nbytes)
            loss = None
            if self.is_last:
                target = target.to(self.device)
                loss = checked_loss(self.loss_fn(out[OUTPUT_KEY], target)) / self.m
        self._sync()
        t1 = time.time()
        self.stats.fwd_ms.append((t1 - t0) * 1e3)
        self.events.append(TimedEvent(f"{self.stage}F{j}", "F", self.stage, j, t0, t1))
        for key, dsts in self._sends:
            # what the first send's header says of it, on every TP rank of the stage alike (their
            # outputs are the same): whether its gradient comes back
            self._sent_needs_grad.setdefault(key, bool(out[key].requires_grad))
            for t in dsts:
                for r in self.peers_out(t, j):
                    self.p2p.send(out[key], r, j, key, grad=False)
        saved = sum(seen.values())
        if self.is_last and self.loss_workspace_bytes is None:  # once, outside the timed forward
            # on a copy of the loss (an nn.Module or other object keeping state, such as DINO's
            # running centre, moved once more in the first step otherwise): a plain function's
            # globals are the one state this cannot keep apart
            self.loss_workspace_bytes = loss_workspace_bytes(out[OUTPUT_KEY], target,
                                                             _state_copy(self.loss_fn), self.device)
        if self._drop_output:
            out = {k: v for k, v in out.items() if k != OUTPUT_KEY}
        self._inflight[j] = _InFlight(received, out, loss, saved, set(seen),
                                      versions=later_forward.state_versions(self._named_state),
                                      forward_no=self._forwards, saved_state=saved_state,
                                      saved_prints=later_forward.saved_prints(
                                          self._named_state, self._named_ptrs, saved_state) if saved_state else {})
        self._forwards += 1
        self._saved_now += saved
        self.stats.peak_inflight = max(self.stats.peak_inflight, len(self._inflight))
        self._peak(self._saved_now)
        return float(loss.detach()) if loss is not None else 0.0

    def _peak(self, nbytes: int) -> None:
        self.stats.peak_saved_bytes = max(self.stats.peak_saved_bytes, nbytes)

    def _on_recompute(self, saved: dict[int, int]) -> None:
        """A block's recomputation (runtime.recompute) has saved `saved` so far: held on top of
        what the microbatches in flight hold, until this block's backward has used it."""
        st = self._current
        skip = self._state_ptrs | (st.saved_ptrs if st is not None else set())
        self._peak(self._saved_now + sum(n for p, n in saved.items() if p not in skip))

    def _hold_for_weights(self, st: _InFlight) -> None:
        """After a split B: count the gradients the pending W keeps (runtime.split_backward), each
        storage once and not twice with what the forward saved, until that W."""
        from runtime.split_backward import held_tensors

        extra = 0
        for t in held_tensors(st.pending):  # type: ignore[arg-type]
            ptr, nbytes = _storage_key(t)
            if ptr not in st.saved_ptrs and ptr not in self._state_ptrs:
                st.saved_ptrs.add(ptr)
                extra += nbytes
        st.saved_bytes += extra
        self._saved_now += extra
        self._peak(self._saved_now)

    @contextmanager
    def _with_recompute_count(self, st: _InFlight) -> Iterator[None]:
        """While microbatch `st`'s backward runs: count what recomputation saves."""
        self._current = st
        if self.recompute and self.count_memory:
            self.forward_fn.on_recompute = self._on_recompute  # type: ignore[attr-defined]
        try:
            yield
        finally:
            self._current = None
            if self.recompute:
                self.forward_fn.on_recompute = None  # type: ignore[attr-defined]

    @contextmanager
    def _split_refused(self) -> Iterator[None]:
        """B and W apart differentiate a graph twice with `autograd.grad`; torch.compile's
        backward refuses that (donated buffers), so does a reentrant checkpoint, and so does a
        backward that writes into a tensor it saved: say so in one line, with the fix."""
        from profiler.loader import twice_refused

        try:
            yield
        except RuntimeError as exc:
            if (advice := twice_refused(exc)) is not None:
                raise PipeplanError(f"stage {self.stage}, zb-h1: {advice}") from None
            if "modified by an inplace operation" in str(exc):  # (a node run twice finds it changed)
                raise PipeplanError(
                    f"stage {self.stage}, zb-h1: its backward fails when run in two parts, the "
                    f"inputs' gradients (B) and then the weights' (W): {first_line(str(exc).split(':')[0], 120)}. A "
                    "custom autograd.Function whose backward writes into a tensor it saved does "
                    "this, and trains with one backward. Profile the model again (the profile "
                    "marks such layers and ZB-H1 plans run their stage's backward whole) and plan "
                    "again, or plan --schedule 1f1b") from None
            raise

    @contextmanager
    def _changed_by_later_forward(self, j: int, st: _InFlight) -> Iterator[None]:
        """Microbatch j's backward, where it fails on a tensor that a later microbatch's
        forward changed in place (`runtime.later_forward`): say so in one line, with the fix.
        Where autograd would not see it (the first step's saved-tensor hooks), before it runs."""
        if st.saved_state and (names := later_forward.changed_since_saved(  # (the first step's)
                self._named_state, self._named_ptrs, st.versions, st.saved_state, st.saved_prints)):
            raise PipeplanError(later_forward.message(self.stage, j, names, None))
        try:
            yield
        except RuntimeError as exc:
            names = later_forward.changed_by_later_forward(exc, self._named_state, st.versions)
            later = self._forwards - 1 - st.forward_no
            unnamed = (not self.split_backward and later > 0
                       and later_forward.INPLACE_MODIFIED in str(exc))  # (split: `_split_refused`)
            if names or unnamed:
                raise PipeplanError(later_forward.message(self.stage, j, names, exc)) from None
            raise

    def backward(self, j: int) -> None:
        """B: the full backward, or (split) the inputs' gradients only."""
        st = self._inflight[j] if self.split_backward else self._inflight.pop(j)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if st.loss is not None:
            tensors.append(st.loss)
            grads.append(None)
            self._peak(self._saved_now + (self.loss_workspace_bytes or 0))
        for key, dsts in self._sends:
            out = st.outputs[key]
            if not out.is_floating_point():
                continue
            if not self._sent_needs_grad.get(key, False):
                continue  # sent as needing none (`P2P.send`'s header): no gradient comes back
            g = None
            for t in dsts:
                gt = self.p2p.recv(self.peer_in(t, j), j, key, grad=True)
                if gt is not None:  # (None: it reached no loss there)
                    g = gt if g is None else g + gt
            # an output whose gradient is none (the loss does not read it) is left out of the
            # backward, as autograd leaves it: the weights that made only it get no gradient (a
            # zero gradient sent for it moved them under weight decay and momentum)
            if out.requires_grad and g is not None:
                tensors.append(out)
                grads.append(g)
        t0 = time.time()
        input_grads: dict[str, torch.Tensor | None] = {}
        if self.split_backward:
            from runtime.split_backward import backward_input

            keys = list(st.received)
            # a scalar's (the loss's) gradient stays implicit: W would keep it until it runs
            full = [g if g is not None or t.dim() == 0 else torch.ones_like(t)
                    for t, g in zip(tensors, grads, strict=True)]
            with self._with_recompute_count(st), self._split_refused(), \
                    self._changed_by_later_forward(j, st):
                got, st.pending = backward_input(tensors, full, [st.received[k] for k in keys],
                                                 self._weights, direct=self.recompute)
            input_grads = dict(zip(keys, got, strict=True))
            if self.count_memory:
                self._hold_for_weights(st)
        elif tensors:
            with self._with_recompute_count(st), self._changed_by_later_forward(j, st):
                torch.autograd.backward(tensors, grads)
        self._sync()
        t1 = time.time()
        self.stats.bwd_ms.append((t1 - t0) * 1e3)
        self.events.append(TimedEvent(f"{self.stage}B{j}", "B", self.stage, j, t0, t1))
        for key, src in self._recvs:
            x = st.received.get(key)
            if x is None:
                continue
            g = input_grads.get(key) if self.split_backward else x.grad
            for r in self.peers_out(src, j):
                self.p2p.send(g, r, j, key, grad=True)  # (None: it has no gradient)
        if not self.split_backward:
            self._saved_now -= st.saved_bytes

    def backward_weight(self, j: int) -> None:
        """W: the weights' gradients of microbatch j, after its B (split backward)."""
        from runtime.split_backward import backward_weight

        st = self._inflight.pop(j, None)
        if st is None or st.pending is None:
            raise RuntimeError(f"{self.stage}W{j} runs before {self.stage}B{j}")
        if self.recompute:  # W differentiates from the loss again (`direct`)
            self._peak(self._saved_now + (self.loss_workspace_bytes or 0))
        t0 = time.time()
        with self._with_recompute_count(st), self._split_refused(), \
                self._changed_by_later_forward(j, st):
            backward_weight(st.pending, self._weights)  # type: ignore[arg-type]
        self._sync()
        t1 = time.time()
        # bwd_ms[k] is the k-th backward's B + W (W's run in their B's order)
        self.stats.bwd_ms[self._w_done] += (t1 - t0) * 1e3
        self._w_done += 1
        self.events.append(TimedEvent(f"{self.stage}W{j}", "W", self.stage, j, t0, t1))
        st.pending = None
        self._saved_now -= st.saved_bytes


def _state_copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with a state of its own: a deep copy of a callable object or bound method (a plain
    function is itself); `fn` where it cannot be copied."""
    import copy

    try:
        return copy.deepcopy(fn)
    except Exception:  # noqa: BLE001 - an object that refuses copying is measured as it is
        return fn
