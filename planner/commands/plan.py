"""`python -m planner plan profile.json --cluster cluster.json ... -o plan.json`."""

from __future__ import annotations

import argparse

from planner.errors import PipeplanError
from planner.limits import seed_arg


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _flags(text: str) -> list[bool]:
    parts = [x.strip() for x in text.split(",") if x.strip()]
    if not parts or any(x not in ("0", "1") for x in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated 0 or 1, got {text!r}")
    return [x == "1" for x in parts]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan pipeline-parallel training of a profiled model",
                       description="Choose stages, replicas and devices for a profiled model on a "
                       "cluster; write plan.json and print the plan.")
    p.add_argument("profile", help="profile.json (python -m planner profile / import-pipedream)")
    p.add_argument("--cluster", required=True, help="cluster.json")
    p.add_argument("--global-batch", type=int, default=64, help="samples per iteration (64)")
    p.add_argument("--microbatch-size", type=int, help="samples per microbatch (default: the "
                   "largest divisor of the global batch up to the profile's batch size)")
    p.add_argument("--microbatch-sizes", type=_ints, help="cpsat: sizes it may choose among, e.g. 4,8,16")
    p.add_argument("--schedule", choices=["1f1b", "gpipe", "zb-h1", "auto"], default="1f1b",
                   help="1f1b (default), gpipe, zb-h1 (zero bubble: backward split into B and W), "
                   "or auto (the planner chooses the schedule jointly with the partition)")
    p.add_argument("--method", help="cpsat (default when available), pipedream, blocks, params, "
                   "uniform, or manual (with --split)")
    p.add_argument("--objective", choices=["iteration", "throughput"], default="iteration")
    p.add_argument("--optimizer", choices=["sgd", "momentum", "adam"], default="adam")
    p.add_argument("--time-limit", type=float, default=10.0, help="cpsat time limit, seconds")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--powers-of-two", action="store_true", help="cpsat: replica counts 1, 2, 4, ...")
    p.add_argument("--split", type=_ints, help="manual: layers per stage, e.g. 3,3,2")
    p.add_argument("--replicas", type=_ints, help="manual: replicas per stage, e.g. 1,1,2")
    p.add_argument("--recompute", type=_flags, help="manual: recompute activations per stage, "
                   "one 0 or 1 per stage of --split, e.g. 1,0,0")
    p.add_argument("--no-recompute", action="store_true",
                   help="no stage may recompute its activations")
    p.add_argument("--tp", type=_ints, help="manual: tensor-parallel degree per stage, e.g. 2,1 "
                   "(each replica spans that many devices of one node; profile with --tp first)")
    p.add_argument("--max-tp", type=int, help="cpsat: the largest tensor-parallel degree a stage "
                   "may get (default: the largest profiled degree that fits a node; 1: none)")
    p.add_argument("-o", "--output", default="plan.json", help="where to write the plan (plan.json)")
    p.add_argument("--trace", help="also write the predicted timeline as a Chrome trace JSON")
    p.add_argument("--timeline", action="store_true", help="also print a text timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.commands.simulate import show_simulation
    from planner.formats import Cluster, PlanOptions, Profile, option_conflicts
    from planner.io import check_distinct, check_output, load_model, parse_model, save_model
    from planner.limits import max_layers
    from planner.report_table import format_plan
    from planner.simulator import simulate
    from planner.solve import default_method, make_plan

    check_output(args.output, (args.profile, args.cluster))
    check_output(args.trace, (args.profile, args.cluster), "--trace")
    check_distinct([("-o", args.output), ("--trace", args.trace)])
    profile = load_model(args.profile, Profile, f"profile {args.profile}")
    # nor the model file the profile was made from (`-o model.py` replaced the source with JSON)
    check_output(args.output, (profile.model.path,), probe=False)
    check_output(args.trace, (profile.model.path,), "--trace", probe=False)
    cluster = load_model(args.cluster, Cluster, f"cluster {args.cluster}")
    if len(profile.layers) > (most := max_layers()):
        coarser = ("the graph was imported from PipeDream, so no granularity applies: import a graph "
                   "of fewer nodes, or raise PIPEPLAN_MAX_LAYERS (planning takes longer)"
                   if getattr(profile, "source", None) == "pipedream" else
                   "profile the model at a coarser granularity (--granularity blocks, or depth:N)")
        raise PipeplanError(
            f"profile {args.profile} has {len(profile.layers)} layers; the planner plans at most "
            f"{most} (PIPEPLAN_MAX_LAYERS): {coarser}")
    method = args.method or ("manual" if args.split else default_method())
    if args.recompute and any(args.recompute) and args.no_recompute:
        raise PipeplanError("--recompute and --no-recompute contradict each other")
    options = parse_model({
        "global_batch": args.global_batch, "microbatch_size": args.microbatch_size,
        "microbatch_sizes": args.microbatch_sizes, "schedule": args.schedule, "method": method,
        "objective": args.objective, "optimizer": args.optimizer, "time_limit_s": args.time_limit,
        "seed": args.seed, "powers_of_two": args.powers_of_two, "split": args.split,
        "replicas": args.replicas, "recompute": args.recompute,
        "allow_recompute": not args.no_recompute, **({"tp": args.tp} if args.tp else {}),
        **({"max_tp": args.max_tp} if args.max_tp is not None else {}),
    }, PlanOptions, "options")
    conflict = option_conflicts(options, lambda f: "--" + f.replace("_", "-"))
    if conflict:
        raise PipeplanError(conflict)
    plan = make_plan(profile, cluster, options)
    save_model(plan, args.output)
    print(format_plan(plan))
    scale = plan.microbatch_size / profile.batch_size
    if not 0.5 <= scale <= 2:
        print(f"note: the profile was measured at batch {profile.batch_size}; microbatches of "
              f"{plan.microbatch_size} are priced by scaling its times and bytes linearly "
              f"({scale:g}x): profile at --batch-size {plan.microbatch_size} for measured figures")
    print(f"wrote {args.output}")
    if args.trace or args.timeline:
        show_simulation(simulate(plan), args.output, args.trace, args.timeline)
    return 0
