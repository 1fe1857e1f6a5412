"""`python -m planner simulate plan.json [--trace trace.json]`: re-simulate a plan file."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="re-simulate a plan.json and draw its timeline",
                       description="Simulate a plan's schedule with the costs it carries; print "
                       "per-rank busy and idle time, optionally write a Chrome trace.")
    p.add_argument("plan", help="plan.json")
    p.add_argument("--trace", help="write a Chrome trace JSON (Perfetto, chrome://tracing)")
    p.add_argument("--timeline", action="store_true", help="print a text timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.formats import Plan
    from planner.io import check_output, load_model
    from planner.report_table import format_simulation
    from planner.runnable import plan_warnings, runnable_plan
    from planner.simulator import simulate

    check_output(args.trace, (args.plan,), "--trace")
    plan = load_model(args.plan, Plan, f"plan {args.plan}")
    runnable_plan(plan)  # every rank's actions, complete and consistent, as the runtime checks
    for line in plan_warnings(plan):  # as the runtime warns of them
        print(f"warning: {line}", file=sys.stderr)
    sim = simulate(plan)
    print(format_simulation(sim))
    print(f"plan predicted {plan.predicted.iteration_ms:.2f} ms")
    show_simulation(sim, args.plan, args.trace, args.timeline)
    return 0


def show_simulation(sim: object, plan_path: str, trace: str | None, timeline: bool) -> None:
    """The `--trace FILE` and `--timeline` outputs of `plan` and `simulate`."""
    from planner.io import write_text_atomic
    from planner.trace import chrome_trace, text_timeline

    if trace:
        write_text_atomic(trace, json.dumps(chrome_trace(sim, {"plan": plan_path})))
        print(f"wrote {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    if timeline:
        print(text_timeline(sim))
