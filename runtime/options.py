"""The options of a run (`python -m runtime ...`), shared by the launcher and every rank."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RunOptions:
    plan: str
    model: str
    steps: int = 5
    lr: float = 0.01
    optimizer: str = "sgd"  # sgd | momentum | adam
    weight_decay: float = 0.0  # decoupled for adam (AdamW), L2 for sgd and momentum
    clip_grad_norm: float | None = None  # the whole model's gradient norm, over every stage
    lr_schedule: str = "constant"  # constant | linear | cosine (runtime.lr_schedule)
    warmup_steps: int = 0
    decay_steps: int = 1  # the global step where linear and cosine reach 0
    seed: int = 0
    save: str | None = None
    save_every: int | None = None  # --save also at every N-th global step
    start_step: int = 0  # the steps the --resume checkpoint has done
    resume: str | None = None
    report: str | None = None
    trace: str | None = None
    timeout: float = 300.0  # seconds a rank waits for a peer before giving up
    threads: int | None = None  # torch's intra-op threads per rank (None: the cores / local ranks)
    allow_mismatch: bool = False
    granularity: str | None = None  # how the profiler traced the model into layers (None: find it)
    trace_info: str | None = None  # the launcher's trace record (runtime.stages.save_trace_info)


def sparse_refused(opts: RunOptions) -> str | None:
    """Why the run's optimizer cannot step a sparse gradient (None: it can)."""
    if opts.optimizer == "adam":
        return ("--optimizer adam does not take sparse gradients (torch.optim.Adam refuses them): "
                "train with --optimizer sgd or momentum, or make the embedding dense (sparse=False)")
    if opts.weight_decay > 0:
        return ("--weight-decay adds the dense weights to the gradient, which torch's SGD refuses "
                "for a sparse one (add(sparse, dense)): train without --weight-decay, or make the "
                "embedding dense (sparse=False)")
    return None
