"""One rank of a pipeline run: set up torch.distributed, build the stage, train, report.

Internal module, entered by `python -m runtime` when the torch.distributed environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; set by torchrun or by runtime.launch) is present.
Semantics are those of single-device training (see runtime/__init__.py).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
import time
import warnings
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from torch import nn

from planner.errors import PipeplanError, describe
from planner.formats import Plan
from planner.io import write_text_atomic
from profiler.host_memory import keep_large_blocks
from profiler.optimizers import make_optimizer
from profiler.tracing import TracingWarning
from runtime import checkpoint, comm, cpu_binding, grad_clip, progress, rng, stages, tensor_parallel
from runtime.comm import P2P, PeerError
from runtime.deadline import Deadline
from runtime.executor import StageExecutor, TimedEvent
from runtime.launch import INTERRUPTED, LAUNCHER_PID_ENV
from runtime.lr_schedule import lr_factor
from runtime.options import RunOptions, sparse_refused
from runtime.report import (
    RankRecord,
    build_report,
    chrome_trace,
    measured_simulation,
    timing_window_steps,
    trim_timings,
)

log = logging.getLogger(__name__)


class NoParameters:
    """The optimizer of a stage without parameters: its step does nothing, its state is empty
    (a checkpoint holds none for it)."""

    def __init__(self) -> None:
        self.state: dict = {}
        self.param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return cls(rank, world, int(os.environ.get("LOCAL_RANK", rank)),
                   int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def _device(env: DistEnv) -> tuple[torch.device, str]:
    """The rank's device and backend: GPU `LOCAL_RANK` with NCCL where the node shows a GPU per
    local rank; GPU 0 where each process is known to be shown only its own (SLURM's
    --gpus-per-task=1, SLURM_GPUS_PER_TASK=1: one device visible to each of several local ranks;
    a GPU shared by every rank would stop NCCL at its start, "Duplicate GPU detected"); else the
    CPU with gloo. Under torchrun across nodes, a node with GPUs but fewer than its ranks is an
    error: its ranks would choose gloo while other nodes choose NCCL, and the group would never
    form."""
    if not torch.cuda.is_available():
        return torch.device("cpu"), "gloo"
    count = torch.cuda.device_count()
    if count >= env.local_world_size:
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank), "nccl"
    shared = LAUNCHER_PID_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ
    if count == 1 and not shared and os.environ.get("SLURM_GPUS_PER_TASK") == "1":
        torch.cuda.set_device(0)
        return torch.device("cuda", 0), "nccl"
    if "TORCHELASTIC_RUN_ID" in os.environ and env.world_size > env.local_world_size:
        # (on one node every rank takes gloo alike: trains on the CPU, as before, with the warning)
        raise PipeplanError(
            f"{env.local_world_size} ranks on this node but {count} GPU(s) visible: start torchrun "
            f"with --nproc-per-node {count} (one rank per GPU; the plan's devices per node must "
            "match), or hide the GPUs (CUDA_VISIBLE_DEVICES=) on every node to train on the CPU")
    if env.local_rank == 0:
        print(f"warning: {env.local_world_size} ranks on this machine but {count} "
              "GPUs: every rank runs on the CPU with gloo (start one rank per GPU to use them)",
              file=sys.stderr, flush=True)
    return torch.device("cpu"), "gloo"


def split_batch(batch: object, microbatch_size: int, m: int
                ) -> tuple[list[tuple[torch.Tensor, ...]], list[torch.Tensor]]:
    """Microbatch j = rows [j*b, (j+1)*b) of every input and of the target, each a copy with
    its own storage: a microbatch whose input or target autograd saves then keeps only its own
    rows alive (a view would keep the whole batch), as the memory model and report count it."""
    inputs, target = batch  # type: ignore[misc]
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    rows = microbatch_size * m
    for what, x in [*((f"input {k}", x) for k, x in enumerate(inputs)), ("the target", target)]:
        if x.dim() == 0 or x.shape[0] != rows:
            raise PipeplanError(
                f"make_batch({rows}) returned {what} of shape {tuple(x.shape)}: every input and the "
                f"target must have exactly {rows} rows (the global batch) in dimension 0, which is "
                f"split into {m} microbatches of {microbatch_size}")
    parts = [x.split(microbatch_size) for x in inputs]
    return ([tuple(p[j].clone() for p in parts) for j in range(m)],
            [t.clone() for t in target.split(microbatch_size)])


def _wait(work: object, timeout_s: float, what: str, device: torch.device) -> None:
    try:  # bounded by the process group's timeout; on CUDA polled finely (`comm.wait_work`)
        comm.wait_work(work, device, timeout_s)
    except Exception as exc:
        raise PeerError(-1, f"{what}: no result within {timeout_s:g} s or a peer failed "
                            f"({describe(exc, 200)})") from None


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as a dense tensor (a sparse one, from nn.Embedding(sparse=True), densified)."""
    return grad.to_dense() if grad.is_sparse else grad


def _resparse(summed: torch.Tensor, any_dense: float) -> torch.Tensor:
    """A gradient summed dense, sparse again where no holder's was dense (every holder's
    sparse gradient has rows as its sparse dimension, as nn.Embedding's)."""
    return summed if any_dense > 0 else summed.to_sparse(1)


class SeededExecutor(StageExecutor):
    """Each forward starts from its own random stream, seeded by (seed, step, stage,
    microbatch): see runtime.rng for what this guarantees."""

    seed: int = 0
    step: int = 0

    def forward(self, j: int, *args: object, **kwargs: object) -> float:  # type: ignore[override]
        rng.seed_forward(self.seed, self.step, self.stage, j)
        return super().forward(j, *args, **kwargs)  # type: ignore[arg-type]


class Worker:
    """Everything one rank holds during a run."""

    def __init__(self, plan: Plan, opts: RunOptions, env: DistEnv) -> None:
        from profiler.loader import load_model_file

        self.plan, self.opts, self.env = plan, opts, env
        self.rank = env.rank
        self.stage = next(s.index for s in plan.stages if self.rank in s.devices)
        self.tp = plan.stages[self.stage].tp
        # replica-major: this rank is TP rank `tp_rank` of replica `replica`
        self.replica, self.tp_rank = divmod(plan.stages[self.stage].devices.index(self.rank), self.tp)
        self.device, self.backend = _device(env)
        self.mf = load_model_file(opts.model)
        self.b, self.m = plan.microbatch_size, plan.num_microbatches

    # ------------------------------------------------------------------ setup
    def setup(self, stuck: Callable[[str], None] | None = None) -> None:
        """Build, trace and cut the model, make the process groups. `stuck` as for `run`: the
        user's code here (up to the trace) runs before any step this rank takes with its
        peers, so none of their timeouts would notice it hang."""
        plan, opts = self.plan, self.opts
        from profiler.loader import build_checked

        watch = Deadline(opts.timeout, f"rank {self.rank}'s setup (build_model, make_batch"
                         + (")" if opts.trace_info else " and one forward of the model, to trace it)"),
                         stuck) if stuck else None
        rng.seed_build(opts.seed)
        model = build_checked(self.mf, self.b)
        self.start_step = 0
        opt_state: dict = {}
        if opts.resume:
            model_state, opt_state, meta = checkpoint.load(opts.resume)
            checkpoint.load_model_state(model, model_state, opts.resume, opts.model)
            checkpoint.check_optimizer_state(model, opt_state, opts.resume, opts.model)  # (torchrun: no launcher's check)
            self.start_step = int(meta["step"])
        self.model_digest = rng.model_digest(model)
        self.structure_digest = rng.structure_digest(model)
        # step start_step's batch, drawn here so that make_batch runs once per step and in
        # order (a make_batch that walks a dataset gives the rows single-device training
        # gets); its first microbatch traces the model
        self.first_batch = self.draw_batch(self.start_step)
        example, _ = split_batch(self.first_batch, self.b, self.m)
        # with the launcher's record of the trace, tracing runs none of the user's code here
        kinds = stages.load_trace_info(opts.trace_info, opts.granularity)
        with warnings.catch_warnings():
            if opts.trace_info or self.rank != 0:  # the launcher (or rank 0) has said it
                warnings.simplefilter("ignore", TracingWarning)
            graph, _ = stages.trace_for_plan(model, example[0], plan, opts.model, opts.granularity,
                                             kinds)
        if watch:
            watch.cancel()  # (an error above ends the rank anyway)
        modules = stages.build_all_stages(graph, plan)
        self.routing = stages.routing_of(modules)
        names = [set(stages.named_tensors(mod)) for mod in modules]
        self.aliases = stages.tie_sets(model)
        # what a checkpoint holds: the model's own keys (a stage's graph module may hold more,
        # e.g. torch.fx's `_tensor_constant0` for a tensor the forward makes from a buffer)
        self.model_keys = frozenset(model.state_dict().keys())
        if self.rank == 0 and not opts.trace_info:  # under torchrun: what the launcher says
            if (note := checkpoint.resume_data_note(self.mf, self.start_step)) is not None:
                print(f"warning: {note}", file=sys.stderr, flush=True)
            if opts.save:  # refused before training, not found replaced after it
                checkpoint.check_same_model(opts.save, model.state_dict(), opts.model)
        # a parameter two stages hold, under several names (tied weights) or under one (a
        # module called at two depths, a top-level parameter used twice): its gradient is
        # summed over them
        self.ties = stages.cross_stage_ties(stages.parameter_name_sets(model), names)
        # every module of the stage (the model's own objects) in the mode build_model left it
        # in, as in single-device training of that model: a BatchNorm the user froze with
        # .eval() stays frozen (`.train()` on the stage set them all to training)
        self.module = modules[self.stage].to(self.device)
        self.forward_fn = None
        if getattr(plan.stages[self.stage], "recompute", False):
            from runtime.recompute import block_modules, recomputed_forward

            blocks = [b.to(self.device) for b in
                      block_modules(graph, list(plan.stages[self.stage].layers))]
            self.forward_fn = recomputed_forward(self.module, blocks)
        tp_plan = (tensor_parallel.model_tp_plan(model, self.mf.tp_plan)
                   if any(st.tp > 1 for st in plan.stages) else {})
        del modules, graph, model  # keep only this rank's stage

        # process groups: every rank creates every group, in the same order. A stage's ranks
        # form a (replicas x tp) mesh: TP groups along its rows, data-parallel groups (the
        # gradient all-reduce) along its columns.
        self.stage_group = None  # this rank's data-parallel group
        tp_group = None
        for st in plan.stages:
            devs, t = list(st.devices), st.tp
            for k in range(st.replicas) if t > 1 else ():
                g = comm.new_group(devs[k * t:(k + 1) * t], self.device, waited_by_torch=True)
                if st.index == self.stage and k == self.replica:
                    tp_group = g
            for u in range(t) if st.replicas > 1 else ():
                g = comm.new_group(devs[u::t], self.device)
                if st.index == self.stage and u == self.tp_rank:
                    self.stage_group = g
        self.mesh = None  # this stage's (replica x tp) DeviceMesh, when it is tensor-parallel
        if tp_group is not None:
            from torch.distributed.device_mesh import DeviceMesh

            st = plan.stages[self.stage]
            if self.stage_group is not None:
                self.mesh = DeviceMesh.from_group(
                    [self.stage_group, tp_group], self.device.type,
                    mesh=torch.tensor(st.devices).view(st.replicas, st.tp),
                    mesh_dim_names=("dp", "tp"))
            else:
                self.mesh = DeviceMesh.from_group(tp_group, self.device.type,
                                                  mesh_dim_names=("tp",))
            sharded = tensor_parallel.parallelize(self.module, tp_plan, self.mesh["tp"])
            if not sharded:
                raise PipeplanError(
                    f"stage {self.stage} has tensor-parallel degree {self.tp} but the model's TP "
                    "plan names none of its modules (define tp_plan(model) in the model file)")
        self.tie_groups = []
        # (the checkpoint's parts only: every rank's measurements are small)
        self.host_group = comm.host_group(self.backend, self.env.world_size) if self.opts.save else None
        self.save_keys = ""  # this attempt's prefix of the save's progress keys in the store
        if self.opts.save:  # rank 0's, so every rank waits on the keys rank 0 writes
            box = [os.urandom(8).hex() if self.rank == 0 else None]
            with comm.collective("agreeing on the checkpoint's keys (--save)", self.opts.timeout):
                dist.broadcast_object_list(box, src=0, group=self.host_group)
            self.save_keys = str(box[0])
        for tie_names, holders in self.ties:
            ranks = sorted(d for s in holders for d in plan.stages[s].devices)
            g = comm.new_group(ranks, self.device)
            if self.stage in holders:
                self.tie_groups.append((tie_names, g))

        self.params = stages.stage_parameters(self.module)
        self.tied_ids = {id(self.params[n]) for names, _ in self.tie_groups for n in names
                         if n in self.params}
        unique: dict[int, nn.Parameter] = {}
        for p in self.params.values():
            unique.setdefault(id(p), p)
        self.unique_params = list(unique.values())
        # a stage of layers without parameters (activations, reshapes) has nothing to step:
        # torch's optimizers refuse an empty parameter list
        self.optimizer = make_optimizer(opts.optimizer, self.unique_params, opts.lr, opts.weight_decay) \
            if self.unique_params else NoParameters()
        # --clip-grad-norm: a tied parameter's gradient is counted by the first stage holding it
        self.counted_elsewhere = {id(self.params[n]) for tie_names, holders in self.ties
                                  if self.stage in holders and self.stage != min(holders)
                                  for n in tie_names if n in self.params}
        if opt_state:
            checkpoint.load_optimizer_state(self.optimizer, self.params, opt_state)

        keys = self.routing.keys()
        names = {d: f"rank {d} (stage {st.index})" for st in plan.stages for d in st.devices}
        self.p2p = P2P(self.rank, self.device, {k: i for i, k in enumerate(keys)}, opts.timeout,
                       names, batched=comm.batched_protocol(self.backend))
        if self.p2p.batched:
            # NCCL matches by order: refuse a plan whose order could hang
            from planner.p2p_order import check_plan

            check_plan(plan, {(s, t) for s in range(len(plan.stages))
                              for _, dsts in self.routing.sends(s) for t in dsts})
        self.executor = SeededExecutor(self.module, self.stage, self.routing,
                                       [list(s.devices) for s in plan.stages], self.p2p,
                                       self.mf.loss_fn, self.m, self.device)
        self.executor.seed = opts.seed
        if self.forward_fn is not None:
            self.executor.forward_fn = self.forward_fn
            self.executor.recompute = True
        self.executor.stage_tp = [st.tp for st in plan.stages]
        for names, holders in self.ties:  # the tied parameters this stage holds, by one name
            if (name := next((n for n in names if n in self.params), None)) is not None:
                self.executor.watched.append((self.params[name], name, (
                    f"it is tied across stages {', '.join(map(str, holders))}: each of them trains its "
                    "own copy, which that change would part from the others. Plan the layers that "
                    "use it in one stage (plan --method manual --split ...), or untie it")))
        replicas = plan.stages[self.stage].replicas
        if replicas > 1:  # each replica would change its copy by its own microbatches' rows
            seen = {id(p) for p, _, _ in self.executor.watched}
            for name, p in self.params.items():
                if id(p) not in seen:  # frozen too (MoCo's key encoder, moved by each forward)
                    seen.add(id(p))
                    self.executor.watched.append((p, name, (
                        f"the stage has {replicas} replicas: each changes its own copy by its own "
                        "microbatches, which parts them from one another. Plan that stage with one "
                        "replica (plan --method manual --replicas ...)")))
        self.executor.tp_rank = self.tp_rank
        if self.mesh is not None:  # saved shards of the parameters are not activations
            self.executor._state = [tensor_parallel.local(t.detach()) for t in self.executor._state]
        from planner.schedules import actions_for_rank

        self.actions = actions_for_rank(plan, self.rank)
        # (planner.runnable has checked that every action is this rank's stage and replica)
        self.last_stage_ranks = plan.stages[-1].replica_ranks()  # one loss per replica
        self.check_same_batch(self.first_batch, self.start_step)  # before anything trains on it

    # ------------------------------------------------------------------ gradients
    def sync_grads(self) -> list[TimedEvent]:
        """Sum each gradient over the stage's replicas (and a tied parameter's over the stages
        that hold it). A parameter no replica used this step keeps no gradient (None), as in
        single-device training, where the optimizer then skips it (momentum, Adam's moments
        and its step count stay as they were): each rank adds a flag per parameter, 1 where it
        has a gradient, to the same all-reduce."""
        events = []
        t0 = time.time()
        if self.stage_group is not None:
            # (a frozen parameter has no gradient on any replica: nothing to sum)
            own = [p for p in self.unique_params if id(p) not in self.tied_ids and p.requires_grad]
            if own:
                # a sharded parameter's gradient: this rank's shard, summed with the same
                # shard of the other replicas
                # a sparse gradient (nn.Embedding(sparse=True)) is summed dense, and stays
                # sparse where no replica's is dense (as one process would accumulate it)
                grads = [_dense(tensor_parallel.local(p.grad)) if p.grad is not None
                         else torch.zeros_like(tensor_parallel.local(p.detach())) for p in own]
                flat = torch.cat([g.reshape(-1) for g in grads])
                used = torch.tensor([float(p.grad is not None) for p in own]
                                    + [float(p.grad is not None and not p.grad.is_sparse) for p in own],
                                    dtype=flat.dtype, device=flat.device)
                flat = torch.cat([flat, used])
                _wait(dist.all_reduce(flat, group=self.stage_group, async_op=True),
                      self.opts.timeout, f"gradient all-reduce of stage {self.stage}", self.device)
                i = 0
                flags = flat[-2 * len(own):].tolist()
                for p, g, anyone, dense in zip(own, grads, flags[:len(own)], flags[len(own):], strict=True):
                    n = g.numel()
                    if anyone > 0:
                        summed = flat[i:i + n].view_as(g)
                        if dense == 0:
                            p.grad = _resparse(summed, dense)
                        else:
                            if p.grad is None or p.grad.is_sparse:
                                p.grad = torch.zeros_like(p)
                            tensor_parallel.local(p.grad).copy_(summed)
                    i += n
        for tie_names, g in self.tie_groups:
            p = next(self.params[n] for n in tie_names if n in self.params)
            grad = _dense(p.grad) if p.grad is not None else torch.zeros_like(p)
            used = torch.tensor([float(p.grad is not None), float(p.grad is not None and not p.grad.is_sparse)],
                                dtype=grad.dtype, device=grad.device)
            buf = torch.cat([grad.reshape(-1), used])
            _wait(dist.all_reduce(buf, group=g, async_op=True), self.opts.timeout,
                  f"gradient sum of tied parameter {tie_names[0]!r}", self.device)
            p.grad = _resparse(buf[:-2].view_as(p), float(buf[-1])) if float(buf[-2]) > 0 else None
        t1 = time.time()
        if self.stage_group is not None or self.tie_groups:
            events.append(TimedEvent(f"allreduce {self.stage}", "allreduce", self.stage, -1, t0, t1))
        return events

    def clip_grads(self) -> float:
        """--clip-grad-norm: the model's gradient norm over every rank (runtime.grad_clip),
        the gradients scaled to it; returns the norm before clipping."""
        mine = grad_clip.squared_sum(self.unique_params, self.replica == 0, self.tp_rank == 0,
                                     self.counted_elsewhere, self.device)
        return grad_clip.clip(self.unique_params, mine, float(self.opts.clip_grad_norm),
                              lambda work, what: _wait(work, self.opts.timeout, what, self.device))

    # ------------------------------------------------------------------ training
    def draw_batch(self, step: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Step `step`'s batch: make_batch(global_batch) after the global generators are seeded
        (`rng.seed_batch`), checked as the profiler checks it (a tuple of tensors and one
        target: a bare tensor or a target of None failed inside split_batch)."""
        from profiler.loader import batch_checked

        rng.seed_batch(self.opts.seed, step)
        inputs, target = batch_checked(self.mf, self.plan.global_batch, step)
        return tuple(inputs), target

    def check_same_batch(self, batch: tuple[tuple[torch.Tensor, ...], torch.Tensor], step: int) -> None:
        """Every rank trains the same model on the same batch: a make_batch that reads a
        per-process state (a generator other than torch's, random's or numpy's global one, a
        file position, the rank) gave the stages other rows, and a build_model that did gave
        replicas other starting weights; training went wrong without a word either way."""
        world = self.env.world_size
        if world == 1:
            return
        batch_other, weights_other, structure_other = _first_others(
            [rng.batch_digest(batch), self.model_digest, self.structure_digest], world, self.device,
            self.opts.timeout, f"comparing the ranks' models and step-{step} batches")
        if (other := structure_other) is not None:  # (named as different weights before: an outside review)
            raise PipeplanError(
                f"build_model() gave ranks 0 and {other} different models: their parameters or "
                "buffers differ in names, shapes or dtypes. Every rank builds the whole model from "
                "the same file; one that depends on the rank, the host or an environment variable "
                "set differently on each rank builds another architecture on some of them")
        if (other := weights_other) is not None:
            raise PipeplanError(
                f"build_model() gave ranks 0 and {other} different weights: every rank builds the "
                "whole model after seeding torch's, Python's random and numpy's global generators "
                "with --seed, so its initial weights must come only from those (or from a file that "
                "is the same on every rank). A generator of its own (np.random.default_rng() "
                "without a fixed seed), the rank or the time gives each replica other starting weights")
        if (other := batch_other) is not None:
            raise PipeplanError(
                f"make_batch({self.plan.global_batch}) gave ranks 0 and {other} different batches "
                f"at step {step}: every rank calls it once per step after seeding torch's, Python's "
                "random and numpy's global generators with seed + step, so it must draw only from "
                "those (or read data that are the same on every rank, in the same order). A "
                "generator of its own (np.random.default_rng() without a fixed seed, a DataLoader "
                "with shuffling), the rank or the time gives each stage other rows")

    def train(self) -> RankRecord:
        plan, opts = self.plan, self.opts
        # every step's time and loss (8 bytes each); the other timings of the last steps only
        # (`report.trim_timings`: a run of days grew every rank by ~32 bytes a microbatch a step)
        step_ms, self.losses = array("d"), array("d")
        comm_ms, idle_ms, opt_ms = [], [], []
        window, dropped = timing_window_steps(), 0
        self._saves = 0  # checkpoints written so far (each has its own key in the store)
        last_events: list[TimedEvent] = []
        every_step_memory = os.environ.get("PIPEPLAN_COUNT_MEMORY") == "every-step"
        for s in range(self.start_step, self.start_step + opts.steps):
            t0 = time.time()
            self.executor.events = []
            c0 = self.p2p.comm_ms
            f0, b0 = len(self.executor.stats.fwd_ms), len(self.executor.stats.bwd_ms)
            if self.rank == 0 and not self.p2p.batched:  # the loss arrives during the last backwards
                for r in self.last_stage_ranks:
                    if r != 0:
                        self.p2p.post_recv(r, 0, "<loss>", grad=False)
            batch = self.first_batch if self.first_batch is not None else self.draw_batch(s)
            self.first_batch = None
            inputs, targets = split_batch(batch, self.b, self.m)
            del batch  # the microbatches are copies: the whole batch is not kept through the step
            counters = rng.int_buffers(self.module) if self.stage_group is not None else {}
            self.executor.step = s
            # the first step measures memory (PIPEPLAN_COUNT_MEMORY=every-step: all, for a model
            # whose saved tensors' sizes depend on the data, e.g. MoE routing)
            self.executor.count_memory = s == self.start_step or every_step_memory
            loss = self.executor.run(self.actions, inputs, targets)
            self.p2p.flush()
            ar = self.sync_grads()
            sparse = [n for n, p in self.params.items() if p.grad is not None and p.grad.is_sparse]
            if sparse and (why := sparse_refused(opts)):
                raise PipeplanError(f"stage {self.stage}: {sparse[0]} has a sparse gradient "
                                    f"(nn.Embedding(sparse=True)) and {why}")
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the all-reduce's copies are not the step's
            o0 = time.time()
            norm = self.clip_grads() if opts.clip_grad_norm is not None else None
            lr = opts.lr * lr_factor(s, opts.lr_schedule, opts.warmup_steps, opts.decay_steps)
            for group in getattr(self.optimizer, "param_groups", ()):
                group["lr"] = lr
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's kernels, not their launch
            o1 = time.time()
            opt_ms.append((o1 - o0) * 1e3)
            if self.stage_group is not None:
                rng.sync_buffers(self.module, counters, plan.stages[self.stage].replicas,
                                 self.stage_group, plan.stages[self.stage].devices[self.tp_rank])
            step_loss = self._gather_loss(loss)
            t1 = time.time()
            ms = (t1 - t0) * 1e3
            step_ms.append(ms)
            busy = sum(self.executor.stats.fwd_ms[f0:]) + sum(self.executor.stats.bwd_ms[b0:]) + opt_ms[-1]
            talk = self.p2p.comm_ms - c0 + sum((e.end_s - e.start_s) * 1e3 for e in ar)
            comm_ms.append(talk)
            idle_ms.append(max(ms - busy - talk, 0.0))
            stats = self.executor.stats
            nf, nb = len(stats.fwd_ms) - f0, len(stats.bwd_ms) - b0  # this step's, as every step's
            if (gone := trim_timings((comm_ms, idle_ms, opt_ms),
                                     ((stats.fwd_ms, nf), (stats.bwd_ms, nb)), window)):
                dropped += gone
                self.executor.forget_backwards(gone * nb)
            last_events = self.executor.events + ar + [
                TimedEvent(f"optimizer {self.stage}", "optimizer", self.stage, -1, o0, o1)]
            if self.rank == 0:
                if not math.isfinite(step_loss) and all(math.isfinite(x) for x in self.losses):
                    print(f"warning: step {s + 1}: the loss is {step_loss} (training diverged: a "
                          "smaller --lr, or the model's data)", file=sys.stderr, flush=True)
                self.losses.append(step_loss)
                extra = "" if norm is None else f"  grad norm {norm:.4g}"
                if opts.lr_schedule != "constant" or opts.warmup_steps:
                    extra += f"  lr {lr:.4g}"
                print(f"step {s + 1}: loss {step_loss:.6f}  {ms:.1f} ms  "
                      f"{plan.global_batch / (ms / 1e3):.1f} samples/s{extra}", flush=True)
            # --save-every: at global steps N, 2N, ... (the run's last step: by finish)
            if (opts.save and opts.save_every and (s + 1) % opts.save_every == 0
                    and s + 1 < self.start_step + opts.steps):
                self.save_checkpoint(s + 1)  # (not timed: the step's figures are taken)
                comm.barrier(self.device, "starting the step after a checkpoint")  # (together)
                if self.rank == 0:
                    print(f"step {s + 1}: checkpoint saved to {opts.save}", flush=True)
        self.p2p.flush()
        st = self.executor.stats
        if self.device.type == "cuda":
            peak, measure = int(torch.cuda.max_memory_allocated(self.device)), "cuda_max_allocated"
        else:
            loc = tensor_parallel.local  # a sharded tensor holds only its shard on this rank
            state_bytes = sum(loc(v).numel() * v.element_size() for stt in self.optimizer.state.values()
                              for v in stt.values() if torch.is_tensor(v))
            pbytes = sum(loc(p.detach()).numel() * p.element_size() for p in self.unique_params)
            gbytes = sum(loc(p.detach()).numel() * p.element_size() for p in self.unique_params
                         if p.requires_grad)  # a frozen parameter has no gradient
            bbytes = sum(b.numel() * b.element_size() for b in self.module.buffers())  # a shared one once
            peak = pbytes + bbytes + gbytes + state_bytes + st.peak_saved_bytes
            measure = "params+buffers+grads+optimizer_state+saved_activations"
        return RankRecord(
            rank=self.rank, stage=self.stage, replica=self.replica, step_ms=step_ms,
            fwd_ms=st.fwd_ms, bwd_ms=st.bwd_ms, comm_ms=comm_ms, idle_ms=idle_ms, optimizer_ms=opt_ms,
            peak_memory_bytes=peak, memory_measure=measure, peak_inflight=st.peak_inflight,
            peak_activation_bytes=st.peak_saved_bytes,
            events=[(e.name, e.kind, e.stage, e.mb, e.start_s, e.end_s) for e in last_events],
            dropped_steps=dropped,
        )

    def _gather_loss(self, loss: float) -> float:
        """Last-stage ranks send their share of the step's loss to rank 0 (non-blocking)."""
        t = torch.tensor([loss], dtype=torch.float64)
        total = 0.0
        if self.rank in self.last_stage_ranks and self.rank != 0:
            self.p2p.send(t, 0, 0, "<loss>", grad=False)
            self.p2p.end_action()  # batched protocol: out now, not with the next step's first batch
        if self.rank == 0:
            for r in self.last_stage_ranks:
                total += loss if r == 0 else float(self.p2p.recv(r, 0, "<loss>", grad=False)[0])
        return total

    # ------------------------------------------------------------------ end of run
    def finish(self, record: RankRecord) -> None:
        opts = self.opts
        records: list[RankRecord | None] = [None] * self.env.world_size
        with comm.collective("collecting every rank's measurements on rank 0", opts.timeout):
            dist.gather_object(record, records if self.rank == 0 else None, dst=0)
        if opts.save:
            self.save_checkpoint(self.start_step + opts.steps)
        if self.rank == 0:
            self._write_outputs([r for r in records if r is not None])

    def save_checkpoint(self, step: int) -> None:
        """--save: every rank's part of the model and optimizer state, written by rank 0 as the
        checkpoint of `step` steps done (every rank must call this). The others wait while rank 0
        writes as long as its write makes progress (`runtime.progress`), not --timeout: a large
        checkpoint may take minutes."""
        opts = self.opts
        assert opts.save is not None
        mine = None
        if self.replica == 0:  # whole tensors: sharded ones gathered over the TP group
            state = {k: tensor_parallel.full(v).detach().cpu().clone()
                     for k, v in self.module.state_dict().items()}
            opt = checkpoint.optimizer_state_by_name(self.optimizer, self.params)
            if self.tp_rank == 0:
                mine = (state, opt)
        parts: list[object] = [None] * self.env.world_size
        with comm.collective("collecting the checkpoint's parts on rank 0 (--save)", opts.timeout):
            dist.gather_object(mine, parts if self.rank == 0 else None, dst=0, group=self.host_group)
        self._saves += 1
        store = comm.default_store()
        # a key of this attempt's (torchrun's restarts keep its store, whose keys of an earlier
        # attempt would say "written"), the same on every rank: the agents' restart counts,
        # which it held before, differ after one node's restart (an agent whose ranks were
        # healthy restarts them without counting), and the others waited on keys rank 0 never
        # wrote until --timeout failed the save
        key = f"pipeplan/save/{self.save_keys}/{self._saves}"
        what = f"writing the checkpoint of step {step} to {opts.save} (--save)"
        if self.rank != 0:
            if store is None:
                comm.barrier(self.device, what)
                return
            outcome = progress.wait_for(store, key, opts.timeout, what)
            if outcome != "ok":
                raise PeerError(0, f"{what}: rank 0 {outcome}")
            return
        counter = progress.Counter()
        with progress.heartbeat(store, key, counter):
            self._write_checkpoint(step, parts, counter)
        if store is None:
            comm.barrier(self.device, what)

    def _write_checkpoint(self, step: int, parts: list[object], counter: progress.Counter) -> None:
        """Rank 0: merge the gathered parts and write them (`save_checkpoint`)."""
        plan, opts = self.plan, self.opts
        assert opts.save is not None
        model_state: dict = {}
        opt_state: dict = {}
        for part in parts:
            if part is not None:
                model_state.update(part[0])  # type: ignore[index]
                opt_state.update(part[1])  # type: ignore[index]
        model_state = {k: v for k, v in stages.complete_aliases(model_state, self.aliases).items()
                       if k in self.model_keys}
        opt_state = stages.complete_aliases(opt_state, self.aliases)
        checkpoint.save(opts.save, model_state, opt_state, {
            "step": step, "seed": opts.seed,
            "optimizer": opts.optimizer, "lr": opts.lr, "weight_decay": opts.weight_decay,
            "clip_grad_norm": opts.clip_grad_norm, "lr_schedule": opts.lr_schedule,
            "warmup_steps": opts.warmup_steps, "decay_steps": opts.decay_steps,
            "profile_sha256": plan.profile_sha256,
            "state_digest": checkpoint.state_digest(model_state),
        }, counter=counter)

    def _write_outputs(self, records: list[RankRecord]) -> None:
        from planner.io import save_model
        from planner.simulator import simulate

        plan, opts = self.plan, self.opts
        try:
            schedule_peak = dict(simulate(plan).peak_inflight)
        except Exception as exc:  # a plan the simulator cannot handle still runs
            log.warning("simulating the plan failed: %s", exc)
            schedule_peak = {}
        report = build_report(plan, records, self.losses, opts.steps, schedule_peak, opts.optimizer)
        if opts.report:
            save_model(report, opts.report)
        if opts.trace:
            sim = measured_simulation(records, report.iteration_ms)
            Path(opts.trace).parent.mkdir(parents=True, exist_ok=True)
            # a temporary file renamed in, as every output: a full disk keeps the previous trace
            write_text_atomic(opts.trace, json.dumps(chrome_trace(sim, plan, report.iteration_ms)))
        pred = plan.predicted.iteration_ms
        meas = report.iteration_ms
        first = self.start_step + 1
        steps = (f"steps {first + 1}-{first + opts.steps - 1}" if opts.steps > 2
                 else f"step {first + opts.steps - 1}")
        ratio = f"{meas / pred:.2f}" if pred > 0 else "n/a"
        print(f"iteration time: predicted {pred:.1f} ms, measured {meas:.1f} ms "
              f"(measured/predicted {ratio}; median of {steps})", flush=True)
        print(f"throughput:     predicted {plan.predicted.throughput_samples_per_s:.1f} samples/s, "
              f"measured {report.samples_per_s:.1f} samples/s", flush=True)
        for r in report.ranks:
            print(f"  rank {r.rank} stage {r.stage} replica {r.replica}: "
                  f"fwd {r.fwd_ms_per_microbatch:.2f} ms/mb, bwd {r.bwd_ms_per_microbatch:.2f} ms/mb, "
                  f"optimizer {getattr(r, 'optimizer_ms', 0.0):.2f} ms, "
                  f"comm {r.comm_ms:.1f} ms, idle {r.idle_ms:.1f} ms, "
                  f"peak in-flight {r.peak_inflight_microbatches}, "
                  f"peak memory {r.peak_memory_bytes / 1e6:.2f} MB", flush=True)


def node_key() -> str:
    """This node's name as `calibrate` writes it: the host, and torchrun's GROUP_RANK where set
    (containers may share a host name)."""
    import socket

    group = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"#{group}" if group is not None else "")


def _planned_node(plan: Plan, rank: int) -> tuple[int, list[int]] | None:
    """The plan's node of process `rank` and the process ranks on it: rank i plays the i-th
    device the plan uses (planner.runnable), idle ones skipped."""
    used = getattr(plan, "device_of_rank", None) or list(range(plan.world_size))
    if rank >= len(used):
        return None
    devices = plan.cluster.devices()
    node_of = [devices[d].node for d in used]
    return node_of[rank], [i for i, n in enumerate(node_of) if n == node_of[rank]]


def layout_warning(plan: Plan, env: DistEnv) -> str | None:
    """Under torchrun: where the ranks this node was given are not one node of the plan's
    cluster (the plan counts ranks node by node, so the ranks of its node n are consecutive),
    the plan's same-node and cross-node links are not the ones it runs on. Correct either
    way, only slower than predicted: a warning, from each node's first rank."""
    planned = _planned_node(plan, env.rank)
    if planned is None:
        return None
    node, ranks = planned
    start = env.rank - env.local_rank
    if ranks == list(range(start, start + env.local_world_size)):
        return None
    spec = plan.cluster.node_specs()[node]
    return (f"torchrun started ranks {start}-{start + env.local_world_size - 1} on this node, but "
            f"the plan has rank {env.rank} on node {spec.name!r} with ranks {ranks[0]}-{ranks[-1]} "
            f"({len(ranks)} of its {spec.devices} devices): the plan's same-node and cross-node "
            "links are not the ones it runs on. Training is correct but slower than predicted; "
            f"start torchrun with --nproc-per-node {len(ranks)} on that node and the nodes in "
            f"the cluster's order ({PIN_NODES}), or plan for this layout")


# torchrun's c10d rendezvous ignores --node-rank (it says so) and numbers the nodes itself
PIN_NODES = ("torchrun --rdzv-backend static --master-addr HOST --master-port PORT --node-rank N "
             "with N the node's place in it: the c10d rendezvous ignores --node-rank")


def node_name_warning(plan: Plan, env: DistEnv, here: str) -> str | None:
    """Under torchrun, on a cluster that `calibrate` measured node by node (nodes named
    "host#GROUP_RANK", `node_key`): where this node `here` is not the plan's node of this rank,
    torchrun numbered the nodes in another order than when they were measured (c10d rendezvous
    may), and a plan for nodes that differ (speed, memory) runs on the wrong ones."""
    specs = plan.cluster.node_specs()
    planned = _planned_node(plan, env.rank)
    if planned is None or not all("#" in n.name for n in specs):
        return None
    name = specs[planned[0]].name
    if name == here:
        return None
    return (f"rank {env.rank} runs on {here}, but the plan put it on {name} (as calibrate "
            "named the nodes): torchrun numbered the nodes in another order than when they were "
            "measured, so the stages may run on nodes of other speed or memory than planned; "
            f"start the nodes in the cluster file's order ({PIN_NODES})")


def start_rank(env: DistEnv, device: torch.device, backend: str, timeout_s: float,
               threads: int | None = None) -> None:
    """What every rank of ours (the runtime's, calibrate's) does before its work: torch threads
    (`threads`, default the node's CPUs over its ranks), glibc's large blocks kept as the
    profiler keeps them (the run pays what the profile priced), the process group, and the
    CPU binding where `PIPEPLAN_CPU_BIND=1` asks for it."""
    threads = threads or cpu_binding.default_threads(env.local_world_size)
    torch.set_num_threads(threads)
    keep_large_blocks()
    comm.init_process_group(backend, device, env.rank, env.world_size, timeout_s)
    cpu_binding.bind_rank(env.rank, device.type, node_key(), env.local_rank, threads,
                          cpu_binding.gather_all)


# the options every rank must share (the training rule, how long, when to save): torchrun
# nodes started with different ones deadlock or train apart
_SHARED_OPTIONS = ("steps", "lr", "optimizer", "weight_decay", "clip_grad_norm",
                   "lr_schedule", "warmup_steps", "decay_steps", "seed", "save_every", "granularity")


def _digest(doc: object) -> int:
    """`digest_data` of a JSON document, cut to what an int64 tensor carries."""
    from planner.formats import digest_data

    return int(digest_data(doc)[:15], 16)


def check_same_plan(plan: Plan, opts: RunOptions, env: DistEnv, device: torch.device) -> None:
    """Every rank runs the same plan with the same options, checked once the process group
    stands: torchrun nodes given different plan files (a stale copy on one node) deadlocked and
    named a healthy peer, or sent tensors of other shapes that failed in the user's loss."""
    if env.world_size == 1:
        return
    runs = plan.model_dump(mode="json", include={"model", "schedule", "global_batch", "microbatch_size",
                                                 "num_microbatches", "stages", "rank_actions", "generator"})
    for st in runs["stages"]:
        st.pop("predicted", None)  # the planner's figures, not what runs
    shared = {**{k: getattr(opts, k) for k in _SHARED_OPTIONS},
              "saves": opts.save is not None, "resume": opts.resume is not None}
    plan_other, options_other = _first_others([_digest(runs), _digest(shared)], env.world_size,
                                              device, opts.timeout, "comparing the ranks' plans and options")
    if (other := plan_other) is not None:
        raise PipeplanError(
            f"rank {other} runs another plan than rank 0 (their plan files differ in the stages, "
            "the schedule or the microbatching): give every node the same plan.json")
    if (other := options_other) is not None:
        raise PipeplanError(
            f"rank {other} was started with other training options than rank 0 (--steps, --lr, "
            "--optimizer, --seed, the learning-rate schedule, --save/--save-every or --resume "
            "differ): start every node with the same options")


def _first_others(values: list[int], world: int, device: torch.device, timeout_s: float,
                  what: str) -> list[int | None]:
    """Every rank's `values` (int64s) gathered; per value, the first rank whose value is not
    rank 0's (None: all the same)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(world)]
    _wait(dist.all_gather(every, mine, async_op=True), timeout_s, what, device)
    table = [t.tolist() for t in every]
    return [next((r for r, row in enumerate(table) if row[i] != table[0][i]), None)
            for i in range(len(values))]


def run(plan: Plan, opts: RunOptions, env: DistEnv, stuck: Callable[[str], None] | None = None) -> None:
    """Run one rank to the end; exceptions propagate (the caller reports them). `stuck(message)`
    (ends the process) where setup's own code — build_model, make_batch, under torchrun the
    trace's forward — has not finished within --timeout (`runtime.deadline`)."""
    if "GROUP_RANK" in os.environ and env.local_rank == 0:  # torchrun's; not our local launcher
        for said in (layout_warning(plan, env), node_name_warning(plan, env, node_key())):
            if said:
                print(f"warning: {said}", file=sys.stderr, flush=True)
    worker = Worker(plan, opts, env)
    start_rank(env, worker.device, worker.backend, opts.timeout, opts.threads)
    check_same_plan(plan, opts, env, worker.device)
    worker.setup(stuck)
    gc.collect()
    gc.freeze()  # the model and torch's own objects: no cyclic-GC pauses over them mid-step
    record = worker.train()
    worker.finish(record)
    comm.barrier(worker.device, "waiting for every rank to finish")  # nobody tears down while a peer still talks to it
    dist.destroy_process_group()


def end_rank(env: DistEnv, exc: BaseException, error_file: str | None) -> NoReturn:
    """Report `exc` (`report_failure`) and end this rank now, with status 2 for the user's
    input, 130 for Ctrl-C, else 1 (the runtime's and calibrate's ranks)."""
    report_failure(env, exc, error_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2 if isinstance(exc, PipeplanError) else 130 if isinstance(exc, KeyboardInterrupt) else 1)


def report_failure(env: DistEnv, exc: BaseException, error_file: str | None) -> None:
    """Tell the launcher (error file) or the user (stderr) what failed on this rank."""

    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C (torchrun passes SIGINT on to every rank)
        kind, text = "user", INTERRUPTED
    else:
        kind = "peer" if isinstance(exc, PeerError) else "user" if isinstance(exc, PipeplanError) else "error"
        text = str(exc) if kind != "error" else _traceback_text(exc)
    if error_file:
        Path(error_file).write_text(json.dumps({
            "rank": env.rank, "kind": kind, "message": f"rank {env.rank}: {text}", "time": time.time(),
            **({"peer": exc.peer} if isinstance(exc, PeerError) else {}),
        }))
    else:
        print(f"error: rank {env.rank}: {text}", file=sys.stderr, flush=True)


def _traceback_text(exc: BaseException) -> str:
    """The traceback of an unexpected error on a rank. Where it passes through the user's own
    files (their model raised), only those frames and the error: the frames of the runtime,
    torch.fx and torch.nn around them (some forty lines) say nothing to the user. Otherwise
    (a fault of ours or of a library) all of it; PIPEPLAN_FULL_TRACEBACK=1: always all."""
    import traceback

    full = "".join(traceback.format_exception(exc)).rstrip()
    if os.environ.get("PIPEPLAN_FULL_TRACEBACK") == "1":
        return full
    ours = [str(Path(__file__).resolve().parents[1] / d) for d in ("runtime", "planner", "profiler", "api")]
    libs = [str(Path(torch.__file__).resolve().parents[1]), str(Path(os.__file__).resolve().parent)]

    def users(filename: str) -> bool:
        f = str(Path(filename).resolve()) if not filename.startswith("<") else ""
        return bool(f) and not any(f.startswith(x) for x in ours + libs)

    frames = [fr for fr in traceback.extract_tb(exc.__traceback__) if users(fr.filename)]
    if not frames:
        return full
    shown = "".join(traceback.format_list(frames))
    last = "".join(traceback.format_exception_only(exc)).rstrip()
    return ("Traceback (your code's frames; PIPEPLAN_FULL_TRACEBACK=1 shows all):\n"
            f"{shown}{last}")
