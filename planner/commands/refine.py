"""`python -m planner refine PLAN REPORT -o NEW_PLAN [--profile profile.json]`: correct the
profile and the cluster from a measured run and plan again (see planner.refine)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("refine", help="correct profile and cluster from a run's report, re-plan",
                       description="Fit per-stage compute scales, the links' effective latency and "
                       "memory scales from a run's report.json; print them; write them "
                       "(corrections.json) with the corrected cluster (and profile), and a new plan.")
    p.add_argument("plan", help="the plan.json that was run")
    p.add_argument("report", help="its report.json (python -m runtime ... --report)")
    p.add_argument("-o", "--output", required=True, help="where to write the new plan")
    p.add_argument("--profile", help="the profile the plan was made from: with it the planner may "
                   "choose new stages; without it the plan keeps its stages, with corrected costs")
    p.add_argument("--corrections", help="where to write the corrections (default: "
                   "NEW_PLAN with .corrections.json)")
    p.add_argument("--cluster-out", help="corrected cluster.json (default: NEW_PLAN with .cluster.json)")
    p.add_argument("--profile-out", help="corrected profile.json, with --profile (default: NEW_PLAN "
                   "with .profile.json)")
    p.set_defaults(func=run)


def _beside(output: str, suffix: str) -> str:
    out = Path(output)
    stem = out.name[:-len(".json")] if out.name.endswith(".json") else out.name
    return str(out.with_name(stem + suffix))


def run(args: argparse.Namespace) -> int:
    import json

    from pydantic import BaseModel

    from planner.formats import Plan, Profile, Report, digest
    from planner.io import (
        check_distinct,
        check_output,
        check_readable,
        load_model,
        write_texts_atomic,
    )
    from planner.refine import (
        check_profile_applies,
        corrected_cluster,
        corrected_plan,
        corrected_profile,
        fit,
        format_corrections,
    )
    from planner.report_table import format_plan
    from planner.runnable import runnable_plan
    from planner.solve import make_plan

    if args.profile_out and not args.profile:
        from planner.errors import PipeplanError

        raise PipeplanError("--profile-out names where the corrected profile goes, but without "
                            "--profile there is none: give the profile the plan was made from "
                            "with --profile, or leave --profile-out out")
    corr_path = args.corrections or _beside(args.output, ".corrections.json")
    cluster_path = args.cluster_out or _beside(args.output, ".cluster.json")
    profile_path = args.profile_out or _beside(args.output, ".profile.json")
    inputs = (args.plan, args.report, args.profile)
    # an output the user did not name is named as what it is (the errors said "--corrections"
    # of a path derived from -o)
    outs = [("-o", args.output),
            ("--corrections" if args.corrections else "the corrections file beside -o", corr_path),
            ("--cluster-out" if args.cluster_out else "the corrected cluster file beside -o", cluster_path),
            ("--profile-out" if args.profile_out else "the corrected profile file beside -o",
             profile_path if args.profile else None)]
    for what, path in outs:
        check_output(path, inputs, what)
    check_distinct(outs)
    plan = load_model(args.plan, Plan, f"plan {args.plan}")
    for what, path in outs:  # nor the model file the plan is of
        check_output(path, (plan.model.path,), what, probe=False)
    # every rank's actions complete and consistent, as `simulate` and the runtime check them
    # (a hand-edited plan with a device its cluster lacks ended refine in a traceback)
    runnable_plan(plan)
    report = load_model(args.report, Report, f"report {args.report}")
    profile = None
    if args.profile:  # checked before anything is written
        profile = load_model(args.profile, Profile, f"profile {args.profile}")
        if digest(profile) != plan.profile_sha256:
            from planner.errors import PipeplanError

            raise PipeplanError(f"--profile {args.profile} is not the profile {args.plan} was made "
                                "from (its sha256 differs); give that profile")
        # (a plan refine corrected without --profile keeps its profile's sha256, not its costs)
        check_profile_applies(plan, args.plan, f"--profile {args.profile}")
    if report.steps == 1:  # the report's medians are then of the first step alone
        import sys

        print(f"warning: the report {args.report} measured one step, the first, which also pays "
              "one-time costs (allocations, first messages, warm caches): its corrections may be off "
              "for later steps. Run with --steps 3 or more for figures of the steady state",
              file=sys.stderr)
    corrections = fit(plan, report)
    cluster = corrected_cluster(plan.cluster, corrections)
    print(format_corrections(corrections))
    # everything is made and checked before anything is written: a run that fails writes nothing
    new_profile = None
    if profile is not None:
        new_profile = corrected_profile(profile, corrections, plan.options.optimizer)
        new_plan = make_plan(new_profile, cluster, plan.options)
    else:
        new_plan = corrected_plan(plan, corrections, cluster)
    outputs: list[tuple[BaseModel, str]] = [(corrections, corr_path), (cluster, cluster_path),
                                            (new_plan, args.output)]
    if new_profile is not None:
        outputs.append((new_profile, profile_path))
    cause = (f"The corrections come from the report {args.report} (iteration {report.iteration_ms:g} ms "
             f"against {report.predicted_iteration_ms:g} predicted): is it this plan's run, on this "
             "cluster? Run the plan again and refine from that report.")
    for model, path in outputs:
        check_readable(model, path, cause, exclude_none=model is cluster)
    # all four or none (a full disk mid-way left new corrections beside the old plan)
    files: list[tuple[str, str]] = [
        (corr_path, corrections.model_dump_json(indent=2) + "\n"),
        (cluster_path, json.dumps(cluster.model_dump(exclude_none=True), indent=2) + "\n"),
        (args.output, new_plan.model_dump_json(indent=2) + "\n")]
    if new_profile is not None:
        files.append((profile_path, new_profile.model_dump_json(indent=2) + "\n"))
    write_texts_atomic(files)
    if new_profile is not None:
        print(f"wrote {corr_path}, {cluster_path}, {profile_path}")
    else:
        print(f"wrote {corr_path}, {cluster_path} (no --profile: the stages stay as they are)")
    print(format_plan(new_plan))
    print(f"wrote {args.output}")
    return 0
