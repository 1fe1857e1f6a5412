"""`python -m runtime plan.json --model model.py --steps N ...`: run a plan.

Without a torch.distributed environment it checks the plan against the model (pre-flight),
then starts one process per device of the plan on this machine and waits for them. Under
torchrun (RANK, WORLD_SIZE, ... set) it is one rank: it checks the world size and runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import get_args

from planner.errors import OneLineParser, PipeplanError, describe
from planner.formats import OptimizerName, Plan
from planner.io import check_distinct, check_output, load_model, not_a_file
from planner.limits import MAX_RUN_SEED, run_seed_arg
from planner.runnable import plan_warnings, runnable_plan
from runtime.lr_schedule import SCHEDULES
from runtime.options import RunOptions

log = logging.getLogger("runtime")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m runtime",
        description="Train a model with a pipeline-parallel plan (one process per device of the "
                    "plan on this machine, or one rank under torchrun).",
    )
    p.add_argument("plan", help="plan.json written by `python -m planner plan`")
    p.add_argument("--model", required=True, help="the model.py the plan was made for")
    p.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 0.01, or the checkpoint's with --resume)")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default=None,
                   help="optimizer (default: the checkpoint's with --resume, else the one the plan "
                        "was made for)")
    p.add_argument("--weight-decay", type=float, default=None, metavar="WD",
                   help="weight decay: decoupled with --optimizer adam (AdamW), L2 with sgd and "
                        "momentum (default 0, or the checkpoint's)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the whole model's gradient norm, over every stage, to MAX (as "
                        "torch.nn.utils.clip_grad_norm_ in one process; 0: no clipping; default: "
                        "none, or the checkpoint's)")
    p.add_argument("--lr-schedule", choices=list(SCHEDULES), default=None,
                   help="the learning rate after warm-up: constant, or falling to 0 at "
                        "--decay-steps, linear or cosine (default constant, or the checkpoint's)")
    p.add_argument("--warmup-steps", type=int, default=None, metavar="N",
                   help="steps over which the learning rate rises linearly from 0 (default 0, "
                        "or the checkpoint's)")
    p.add_argument("--decay-steps", type=int, default=None, metavar="N",
                   help="the global step where a linear or cosine schedule reaches 0 (default: "
                        "the last step of this run, or the checkpoint's)")
    p.add_argument("--seed", type=run_seed_arg, default=None,
                   help="seed of the model and the batches (default 0, or the checkpoint's)")
    p.add_argument("--save", metavar="DIR", help="write the trained state dict (+ optimizer state)")
    p.add_argument("--save-every", type=int, default=None, metavar="N",
                   help="with --save: also write the checkpoint after every N-th step (global "
                        "steps N, 2N, ...), each over the last")
    p.add_argument("--resume", metavar="DIR", help="continue from a --save directory")
    p.add_argument("--report", metavar="FILE", help="write report.json")
    p.add_argument("--trace", metavar="FILE", help="write the measured last step as a Chrome trace")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds a rank waits for a peer before it gives up (default 300)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per rank (default: this machine's cores / the ranks on it; "
                        "1 on a machine other jobs keep busy)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="run even if the model file changed since it was profiled")
    p.add_argument("--granularity", default=None,
                   help="layer granularity of the profile (default: the plan's, else blocks or modules, whichever has the plan's layers)")
    p.add_argument("--trace-info", default=None, help=argparse.SUPPRESS)  # launcher -> ranks
    return p


def _resume_meta(directory: str) -> dict[str, object]:
    """The optimizer, learning rate and seed a checkpoint was trained with (its meta.json)."""
    from runtime.checkpoint import files_of

    path = files_of(directory)[0]["meta.json"]
    if not path.is_file():
        raise PipeplanError(f"--resume {directory}: no checkpoint there (no meta.json); give a "
                            "directory written by --save")
    try:
        meta = dict(json.loads(path.read_text()))
    except (ValueError, TypeError, RecursionError):
        raise PipeplanError(f"--resume {directory}: meta.json is not valid JSON; the checkpoint "
                            "is damaged") from None
    kinds = {"step": int, "lr": (int, float), "seed": int, "optimizer": str,
             "weight_decay": (int, float), "clip_grad_norm": (int, float, type(None)),
             "lr_schedule": str, "warmup_steps": int, "decay_steps": int}
    bad = [k for k, t in kinds.items() if k in meta and (not isinstance(meta[k], t) or isinstance(meta[k], bool))]
    if not bad:  # values --save never writes, which failed on every rank after the launch
        lr, seed = meta.get("lr", 0.0), meta.get("seed", 0)
        clip = meta.get("clip_grad_norm")
        bad = [k for k, ok in (("step", 0 <= meta.get("step", 0) <= MAX_RUN_STEPS),
                               ("lr", lr_ok(lr)),
                               ("seed", 0 <= seed <= MAX_RUN_SEED),
                               ("optimizer", meta.get("optimizer", "sgd") in get_args(OptimizerName)),
                               ("weight_decay", lr_ok(meta.get("weight_decay", 0.0))),
                               ("clip_grad_norm", clip is None or (math.isfinite(clip) and clip >= 0)),
                               ("lr_schedule", meta.get("lr_schedule", "constant") in SCHEDULES),
                               ("warmup_steps", 0 <= meta.get("warmup_steps", 0) <= MAX_RUN_STEPS),
                               ("decay_steps", 1 <= meta.get("decay_steps", 1) <= MAX_RUN_STEPS))
               if not ok]
    if "step" not in meta or bad:
        what = ", ".join(f"{k} {meta[k]!r}" for k in bad) if bad else "no step"
        raise PipeplanError(f"--resume {directory}: meta.json is not what --save writes ({what}); "
                            "the checkpoint is damaged: resume from another one or start again")
    return meta


MAX_LR = 1e6  # beyond it a typo; above float32's range the optimizer step itself fails
MAX_RUN_STEPS = 2**40  # steps (done, to run, of a schedule): seed + step must stay a torch seed


def lr_ok(lr: float) -> bool:
    """A learning rate the runtime takes (`--lr`, a checkpoint's meta.json): 0 to MAX_LR."""
    return math.isfinite(lr) and 0 <= lr <= MAX_LR


MIN_TIMEOUT_S = 1.0  # --timeout below this fails the rendezvous itself
MAX_TIMEOUT_S = 1e7  # ~115 days; 1e14 overflowed the process group's timedelta on every rank


def options_from_args(args: argparse.Namespace, plan: Plan) -> RunOptions:
    if not 1 <= args.steps <= MAX_RUN_STEPS:
        raise PipeplanError(f"--steps {args.steps}: give from 1 to {MAX_RUN_STEPS} steps")
    if not (math.isfinite(args.timeout) and MIN_TIMEOUT_S <= args.timeout <= MAX_TIMEOUT_S):
        # nan and inf passed `<= 0` and crashed every rank in init_process_group; under a
        # second, gloo's own connect timed out before the ranks had started
        raise PipeplanError(f"--timeout {args.timeout:g}: give a finite number of seconds, from "
                            f"{MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g} (the time a rank waits for a peer)")
    if args.threads is not None:
        from profiler.profile import check_threads

        check_threads(args.threads)
    if args.lr is not None and not lr_ok(args.lr):
        raise PipeplanError(f"--lr {args.lr:g}: give a learning rate from 0 to {MAX_LR:g}")
    # a checkpoint's files are inputs (--resume) or outputs (--save) as well: a report written
    # over the model.pt being resumed from destroyed it, with exit code 0
    from runtime.checkpoint import META_FILE, MODEL_FILE, OPTIMIZER_FILE

    ckpt = [str(Path(d) / f) for d in (args.resume, args.save) if d
            for f in (MODEL_FILE, OPTIMIZER_FILE, META_FILE)]
    inputs = (args.plan, args.model, *ckpt)
    writer = os.environ.get("RANK", "0") == "0"  # the launcher, or rank 0: the one that writes
    check_output(args.report, inputs, "--report", probe=writer)
    check_output(args.trace, inputs, "--trace", probe=writer)
    check_distinct([("--report", args.report), ("--trace", args.trace)])
    if args.save_every is not None and (args.save is None or args.save_every < 1):
        raise PipeplanError(f"--save-every {args.save_every}: give a number of steps, 1 or more, "
                            "and --save DIR, the directory the checkpoints go to")
    if args.save is not None:
        save = Path(args.save)
        if save.exists() and not save.is_dir():
            raise PipeplanError(f"--save {args.save}: is a file; --save writes a directory")
        from runtime.checkpoint import holds_other_files

        # (the writer's check only: the others read the directory while rank 0's write probe
        # below makes and removes a file in it, and one of them refused the run now and then)
        if writer and holds_other_files(save):
            raise PipeplanError(
                f"--save {args.save}: the directory holds files but no checkpoint (no meta.json), "
                "and --save would overwrite model.pt and optimizer.pt there: give a new or empty "
                "directory, or one an earlier --save wrote")
        check_output(save / "model.pt", (args.plan, args.model), "--save", probe=writer)  # (in place: allowed)
    granularity = args.granularity or getattr(plan, "granularity", None)
    meta = _resume_meta(args.resume) if args.resume else {}
    optimizer = args.optimizer or meta.get("optimizer") or plan.options.optimizer
    if meta.get("optimizer") and optimizer != meta["optimizer"]:
        raise PipeplanError(
            f"--optimizer {optimizer}: the checkpoint in {args.resume} was trained with "
            f"{meta['optimizer']} and holds its state; resume with --optimizer {meta['optimizer']} "
            "(or leave --optimizer out)")
    lr = args.lr if args.lr is not None else float(meta.get("lr", 0.01))
    seed = args.seed if args.seed is not None else int(meta.get("seed", 0))
    rule = _training_rule(args, meta)
    return RunOptions(
        plan=args.plan, model=args.model, steps=args.steps, lr=lr,
        optimizer=optimizer, seed=seed, save=args.save, save_every=args.save_every,
        start_step=int(meta.get("step", 0)), **rule,  # type: ignore[call-overload]
        resume=args.resume, report=args.report, trace=args.trace, timeout=args.timeout,
        allow_mismatch=args.allow_mismatch, granularity=granularity,
        trace_info=getattr(args, "trace_info", None), threads=args.threads,
    )


def _training_rule(args: argparse.Namespace, meta: dict[str, object]) -> dict[str, object]:
    """--weight-decay, --clip-grad-norm and the learning-rate schedule: given, else the
    checkpoint's (--resume), else none. A schedule's --decay-steps defaults to this run's last
    step, so a resumed run keeps the one its checkpoint was trained towards."""
    def given(name: str, default: object) -> object:
        value = getattr(args, name)
        return value if value is not None else meta.get(name, default)

    def said(name: str) -> str:  # where a value came from
        flag = "--" + name.replace("_", "-")
        return flag if getattr(args, name) is not None or name not in meta else \
            f"{flag} (the checkpoint's)"

    wd, clip = float(given("weight_decay", 0.0)), given("clip_grad_norm", None)  # type: ignore[arg-type]
    if not lr_ok(wd):
        raise PipeplanError(f"--weight-decay {wd:g}: give a weight decay from 0 to {MAX_LR:g}")
    if clip is not None and not (math.isfinite(clip) and clip >= 0):  # type: ignore[arg-type]
        raise PipeplanError(f"--clip-grad-norm {clip:g}: give the largest gradient norm, a "
                            "positive number (0: no clipping)")
    schedule, warmup = str(given("lr_schedule", "constant")), int(given("warmup_steps", 0))  # type: ignore[call-overload]
    last = int(meta.get("step", 0)) + args.steps  # type: ignore[call-overload]
    decay = int(given("decay_steps", last))  # type: ignore[call-overload]
    for name, value in (("warmup_steps", warmup), ("decay_steps", decay)):
        if not 0 <= value <= MAX_RUN_STEPS:
            raise PipeplanError(f"--{name.replace('_', '-')} {value}: give from 0 to {MAX_RUN_STEPS} steps")
    if schedule != "constant" and decay <= warmup:
        raise PipeplanError(f"{said('decay_steps')} {decay}: a {schedule} schedule falls to 0 after "
                            f"its {warmup} warm-up steps ({said('warmup_steps')}), so give more "
                            "steps than those")
    return {"weight_decay": wd, "clip_grad_norm": float(clip) if clip else None,  # type: ignore[arg-type]
            "lr_schedule": schedule, "warmup_steps": warmup, "decay_steps": max(decay, 1)}


def describe_rule(opts: RunOptions) -> str:
    """The training rule beyond the optimizer and its rate, as the launcher says it."""
    parts = []
    if opts.weight_decay:
        parts.append(f"weight decay {opts.weight_decay:g}"
                     + (" (AdamW)" if opts.optimizer == "adam" else " (L2)"))
    if opts.clip_grad_norm is not None:
        parts.append(f"gradient norm clipped to {opts.clip_grad_norm:g}")
    if opts.warmup_steps:
        parts.append(f"{opts.warmup_steps} warm-up steps")
    if opts.lr_schedule != "constant":
        parts.append(f"{opts.lr_schedule} decay to 0 at step {opts.decay_steps}")
    return "".join(f", {p}" for p in parts)


def warn_plan(plan: Plan, opts: RunOptions) -> None:
    """What runs, but not as the plan was made for: another optimizer than the plan's (its
    memory and step times are priced for the plan's: Adam keeps two states per parameter,
    momentum one, SGD none), and keys of the plan or its stages this pipeplan does not read
    (a hand edit's typo)."""
    if opts.optimizer != plan.options.optimizer:
        print(f"warning: the plan was made for --optimizer {plan.options.optimizer} and this run "
              f"uses {opts.optimizer}: its memory and optimizer-step times are priced for "
              f"{plan.options.optimizer} (plan again with --optimizer {opts.optimizer})",
              file=sys.stderr)
    for line in plan_warnings(plan):
        print(f"warning: {line}", file=sys.stderr)


def check_model_hash(plan: Plan, model_path: str, allow_mismatch: bool, quiet: bool) -> None:
    from profiler.loader import file_sha256

    if not os.path.isfile(model_path):
        raise PipeplanError(f"--model {model_path}: {not_a_file(model_path)}")
    actual = file_sha256(model_path)
    if actual == plan.model.sha256:
        return
    text = (f"{model_path} has sha256 {actual[:12]}…, but the plan was made from a profile of a "
            f"file with sha256 {plan.model.sha256[:12]}… ({plan.model.path})")
    if not allow_mismatch:
        raise PipeplanError(f"{text}: profile the model again and make a new plan, or pass "
                            "--allow-mismatch to run the plan anyway")
    if not quiet:
        print(f"warning: {text}; running anyway (--allow-mismatch)", file=sys.stderr)


def check_room_for_checkpoint(directory: str, needed: int) -> None:
    """--save where the checkpoint cannot fit: said before training, not after it (the write
    failed at the end of the run, and the run's training was lost)."""
    import shutil

    place = Path(directory)
    while not place.exists() and place != place.parent:
        place = place.parent
    free = shutil.disk_usage(place).free
    old = sum(f.stat().st_size for f in Path(directory).glob("*.pt")) if Path(directory).is_dir() else 0
    if needed > free:  # (the old files stay until the new ones are written)
        raise PipeplanError(f"--save {directory}: the checkpoint takes about {needed / 1e6:.1f} MB "
                            f"(the model's state and its optimizer's), but only {free / 1e6:.1f} MB "
                            f"are free there{f' (its old checkpoint holds {old / 1e6:.1f} MB)' if old else ''}: "
                            "free space, or --save to another directory")


def preflight(plan: Plan, opts: RunOptions, trace_info: str | None = None) -> str:
    """Before any process starts: the model file matches and has every layer the plan names.
    Returns the granularity the plan's layers were traced at; with `trace_info`, writes there
    what the ranks need to trace the model without running it."""

    from torch import nn

    from profiler.loader import batch_checked, build_checked, eval_mode_note, load_model_file
    from runtime import rng, stages
    from runtime.checkpoint import state_bytes as checkpoint_state_bytes
    from runtime.worker import split_batch

    check_model_hash(plan, opts.model, opts.allow_mismatch, quiet=False)
    warn_plan(plan, opts)
    if opts.resume and not os.path.isdir(opts.resume):
        raise PipeplanError(f"--resume {opts.resume}: no such directory")
    mf = load_model_file(opts.model)
    rng.seed_build(opts.seed)
    model = build_checked(mf, plan.microbatch_size)
    if (note := eval_mode_note(mf, model)) is not None:
        print(f"warning: {note}", file=sys.stderr)
    if opts.resume:
        from runtime import checkpoint

        state, opt_state, _ = checkpoint.load(opts.resume)
        checkpoint.load_model_state(model, state, opts.resume, opts.model)
        checkpoint.check_optimizer_state(model, opt_state, opts.resume, opts.model)
    from runtime.checkpoint import resume_data_note

    if (note := resume_data_note(mf, opts.start_step)) is not None:
        print(f"warning: {note}", file=sys.stderr)
    batch = batch_checked(mf, plan.microbatch_size)
    example, _ = split_batch(batch, plan.microbatch_size, 1)
    try:
        graph, granularity = stages.trace_for_plan(model, example[0], plan, opts.model, opts.granularity)
    except PipeplanError:
        raise
    except Exception as exc:  # the user's model on one microbatch of the plan's size
        raise PipeplanError(
            f"{opts.model}: the model fails on one microbatch of {plan.microbatch_size} rows, the "
            f"plan's microbatch size ({type(exc).__name__}: {describe(exc, 200)}); "
            "make the plan with a --microbatch-size the model accepts (BatchNorm in training needs "
            "more than one row)") from None
    if opts.save:
        from runtime.checkpoint import check_same_model

        check_same_model(opts.save, model.state_dict(), opts.model)
        check_room_for_checkpoint(opts.save, checkpoint_state_bytes(model, opts.optimizer))
    from runtime.options import sparse_refused

    sparse = [n for n, m in model.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse and (why := sparse_refused(opts)):  # (else every rank failed at its first step)
        raise PipeplanError(f"{sparse[0]} is nn.Embedding(sparse=True), whose gradient is a sparse gradient, and {why}")
    hooked = [n for n, p in model.named_parameters()
              if getattr(p, "_backward_hooks", None) or getattr(p, "_post_accumulate_grad_hooks", None)]
    built = stages.build_all_stages(graph, plan)  # (each check below reads them)
    if any(st.tp > 1 for st in plan.stages) or (hooked and len(plan.stages) > 1):
        held = [set(stages.named_tensors(m)) for m in built]
        for names, holders in stages.cross_stage_ties(stages.parameter_name_sets(model), held):
            if set(names) & set(hooked):
                # each stage's backward runs the weight's hooks on its own part of the gradient
                # (the parts are summed after the step's backwards): clamp(a) + clamp(b) where one
                # process computes clamp(a + b)
                print(f"warning: {names[0]} is tied across stages {', '.join(map(str, holders))} and has "
                      "gradient hooks (register_hook / register_post_accumulate_grad_hook): each stage "
                      "runs them on its own part of the gradient, so a hook that is not linear (a clamp, "
                      "a norm) trains otherwise than one process; keep the tied layers on one stage "
                      "(plan --method manual --split) or apply the hook after the backward", file=sys.stderr)
            tp = [s for s in holders if plan.stages[s].tp > 1]
            if tp:
                raise PipeplanError(
                    f"{names[0]} is tied across stages {', '.join(map(str, holders))} and stage "
                    f"{tp[0]} is tensor-parallel (tp {plan.stages[tp[0]].tp}): a weight tied across "
                    "stages cannot be sharded there. Plan that stage with TP degree 1 (--method "
                    "manual --tp), or untie the weight")
    mismatch = (stages.parameter_mismatch(plan, graph, built, opts.model)
                or stages.activation_mismatch(plan, graph, built, opts.model))
    if mismatch and not opts.allow_mismatch:
        raise PipeplanError(f"{mismatch}: build it as it was profiled, or profile it again and make "
                            "a new plan, or pass --allow-mismatch to run the plan anyway")
    if mismatch:
        print(f"warning: {mismatch}; running anyway (--allow-mismatch)", file=sys.stderr)
    if trace_info:
        stages.save_trace_info(graph, granularity, trace_info)
    return granularity


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from runtime.launch import ERROR_FILE_ENV, die_with_launcher

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        die_with_launcher()
        return _rank_main(args, os.environ.get(ERROR_FILE_ENV))
    from runtime.launch import Terminated, put_back, report_terminated, stop_on_signals

    # SIGTERM / SIGHUP in the check before the ranks start: a message, its temporary folder gone
    previous = stop_on_signals()
    try:
        return _launcher_main(args, argv)
    except Terminated as exc:  # before the ranks start
        return report_terminated(exc, ranks_stopped=False)
    except KeyboardInterrupt as exc:  # before the ranks start: the plan's check, build_model
        from planner.cli import _user_frame

        where = _user_frame(exc)
        print("interrupted" + (f" while running {where} (your code: is it waiting or looping "
                               "there?)" if where else ""), file=sys.stderr)
        return 130
    finally:
        put_back(previous)


def _launcher_main(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the plan and the model in this process, then start the ranks and wait for them."""
    import tempfile

    info_dir = tempfile.TemporaryDirectory(prefix="pipeplan-trace-")
    info = os.path.join(info_dir.name, "trace.json")
    locks: list[int] = []  # the --save directory's lock (`lock_directory`), held to the end
    try:
        return _checked_launch(args, argv, info, locks)
    finally:
        info_dir.cleanup()
        for fd in locks:
            os.close(fd)


def _checked_launch(args: argparse.Namespace, argv: list[str], info: str, locks: list[int]) -> int:
    from runtime.deadline import DeadlinePassed, alarm

    try:
        plan = runnable_plan(load_model(args.plan, Plan, "plan"))
        opts = options_from_args(args, plan)
        with alarm(opts.timeout, "the check before the ranks start (build_model, make_batch and "
                   "one forward of the model on a microbatch, to trace it)"):
            granularity = preflight(plan, opts, info)
    except PipeplanError as exc:
        print(f"error: {exc.message if isinstance(exc, DeadlinePassed) else exc}", file=sys.stderr)
        return 2
    from runtime.launch import check_room, launch

    try:
        check_room(plan.world_size, f"the plan ({args.plan})")
        if opts.save:  # one run at a time saves there (let go by `_launcher_main`)
            from runtime.checkpoint import lock_directory

            if (fd := lock_directory(opts.save)) is not None:
                locks.append(fd)
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cores = os.cpu_count() or 1
    if plan.world_size > cores:
        print(f"warning: {plan.world_size} rank processes on {cores} CPU cores; they will share "
              "the cores (for a plan of many devices, start it on its machines with torchrun)",
              file=sys.stderr)
    if opts.resume:
        from runtime.checkpoint import files_of

        if files_of(opts.resume)[1]:
            print(f"warning: the last --save to {opts.resume} was interrupted while it renamed its "
                  "files in: resuming from the checkpoint before it (its files *.prev there)",
                  file=sys.stderr)
    # the optimizer is said where it was not given: a plan made without --optimizer records adam
    source = "" if args.optimizer else " (the checkpoint's)" if opts.resume else " (the plan's)"
    print(f"running {plan.world_size} ranks on this machine "
          f"({len(plan.stages)} stage{'s' if len(plan.stages) > 1 else ''}, "
          f"{plan.num_microbatches} microbatches of "
          f"{plan.microbatch_size}, schedule {plan.schedule}; optimizer {opts.optimizer}{source}, "
          f"lr {opts.lr:g}{describe_rule(opts)})", flush=True)
    start = opts.start_step
    if opts.lr_schedule != "constant" and start + opts.steps > opts.decay_steps:
        print(f"warning: the {opts.lr_schedule} schedule reaches a learning rate of 0 at step "
              f"{opts.decay_steps}, before this run's last step ({start + opts.steps}): the steps "
              "after it train at a rate of 0 (give --decay-steps)", file=sys.stderr, flush=True)
    try:
        extra = [] if args.granularity else ["--granularity", granularity]
        failures = launch(argv + extra + ["--trace-info", info], plan.world_size, opts.threads,
                          peer_wait_s=opts.timeout + 5.0)
    except KeyboardInterrupt as exc:
        from runtime.launch import Terminated, report_terminated

        if isinstance(exc, Terminated):
            return report_terminated(exc, ranks_stopped=True)
        print("interrupted", file=sys.stderr)
        return 130
    if not failures:
        return 0
    first = failures[0]
    print(f"error: {first.message}", file=sys.stderr)
    if first.kind == "crash":
        for f in failures[1:2]:
            print(f"  (then {f.message})", file=sys.stderr)
    return 2 if first.kind == "user" else 1


def _rank_main(args: argparse.Namespace, error_file: str | None) -> int:
    from runtime.launch import as_rank

    return as_rank(_rank_run, args, error_file)


def _rank_run(args: argparse.Namespace, error_file: str | None) -> int:
    from runtime.launch import finished
    from runtime.worker import DistEnv, end_rank, run

    env = DistEnv.from_environ()

    def end(exc: BaseException) -> None:
        """Report `exc` and end this rank now (also from the setup's deadline thread)."""
        end_rank(env, exc, error_file)

    try:
        plan = runnable_plan(load_model(args.plan, Plan, "plan"))
        opts = options_from_args(args, plan)
        if env.world_size != plan.world_size:
            raise PipeplanError(
                f"the plan needs {plan.world_size} processes (one per device of its "
                f"{len(plan.stages)} stages) but WORLD_SIZE is {env.world_size}; start torchrun "
                f"with --nnodes × --nproc-per-node = {plan.world_size}"
            )
        check_model_hash(plan, opts.model, opts.allow_mismatch,
                         quiet=error_file is not None or env.rank != 0)
        if error_file is None and env.rank == 0:  # under torchrun: no preflight said it
            warn_plan(plan, opts)
        run(plan, opts, env, lambda message: end(PipeplanError(message)))
    except BaseException as exc:  # noqa: BLE001 - every failure must end this rank promptly
        end(exc)
    finished(error_file)
    # done and the process group destroyed: skip the interpreter's teardown, where library
    # threads (gloo's, the store's) can abort the process at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
