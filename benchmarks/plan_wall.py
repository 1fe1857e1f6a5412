"""How long does a plan take on the wall clock, before and after a change? (issue 10: "in
10 s"; the search's budget is work, so a change that only makes the search cheaper must give
the same plans, sooner.)

For each instance of the plan-quality suite (`benchmarks/plan_quality.py`'s profiles,
clusters and memory), one `make_plan` in a fresh process per source tree, the trees taking
turns (`--repeats` rounds), so a slow spell of the machine hits both alike. Per row: the
median wall and CPU time of each tree, their ratio, and whether the plans, bounds and work
units are the same to the bit. Prints a table and writes JSON.

    git worktree add /tmp/before <commit>
    PYTHONPATH=. .venv/bin/python benchmarks/plan_wall.py --before /tmp/before \\
        --rows resnet18:fast16x8:tight,gnmt:slow16:tight -o benchmarks/results/plan_wall.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# one plan in a fresh process, with the tree's own planner and plan_quality.py
ONE = r"""
import hashlib, json, sys, time
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/benchmarks"]
import plan_quality as pq
from planner.formats import Cluster, PlanOptions
from planner.solve import make_plan
name, cname, mem = sys.argv[2].split(":")
prof = pq.profiles([name])[name]
b = prof.batch_size
cache = json.loads(pq.LEAST_MEMORY_CACHE.read_text())
gb = cache[f"{name}/{cname}/sgd/{16 * b}/{b}"] * 1.2 if mem == "tight" else 80
cluster = Cluster(**pq.CLUSTERS[cname], device_memory_gb=gb)
opts = PlanOptions(global_batch=16 * b, optimizer="sgd", time_limit_s=float(sys.argv[3]),
                   schedule="1f1b", microbatch_size=b)
t, c = time.perf_counter(), time.process_time()
plan = make_plan(prof, cluster, opts)
wall, cpu = time.perf_counter() - t, time.process_time() - c
key = [(s.layers[0], s.layers[-1], s.devices, s.recompute, s.tp) for s in plan.stages]
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "planner_ms": plan.predicted.iteration_ms,
                  "bound_ms": plan.solver.bound, "work": plan.solver.model_dump().get("work"),
                  "plan": hashlib.sha256(repr(key).encode()).hexdigest()[:16]}))
"""


def one(tree: Path, row: str, limit: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run([sys.executable, "-c", ONE, str(tree), row, str(limit)], env=env,
                         capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True, help="the source tree to compare with")
    ap.add_argument("--after", type=Path, default=ROOT, help="default: this tree")
    ap.add_argument("--rows", required=True, help="profile:cluster:memory,... (plan_quality.py's names)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("-o", "--out", type=Path, default=ROOT / "benchmarks/results/plan_wall.json")
    args = ap.parse_args()
    rows = []
    print(f"{'instance':34s} {'before s':>9s} {'after s':>8s} {'ratio':>6s} {'cpu before':>10s} "
          f"{'cpu after':>9s}  same plan/bound/work")
    for row in args.rows.split(","):
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for _ in range(args.repeats):
            for side in ("before", "after"):
                runs[side].append(one(getattr(args, side), row, args.time_limit))
        med = {s: {k: statistics.median(r[k] for r in runs[s]) for k in ("wall_s", "cpu_s")} for s in runs}
        first = {s: runs[s][0] for s in runs}
        same = all(first["before"][k] == first["after"][k] for k in ("planner_ms", "bound_ms", "work", "plan"))
        stable = all(r[k] == runs[s][0][k] for s in runs for r in runs[s] for k in ("plan", "work"))
        rec = {"instance": row, "before": runs["before"], "after": runs["after"],
               "median_wall_s": {s: med[s]["wall_s"] for s in med},
               "median_cpu_s": {s: med[s]["cpu_s"] for s in med},
               "wall_ratio": med["after"]["wall_s"] / med["before"]["wall_s"],
               "same_plan_bound_work": same, "same_on_every_repeat": stable}
        rows.append(rec)
        print(f"{row:34s} {med['before']['wall_s']:9.1f} {med['after']['wall_s']:8.1f} "
              f"{rec['wall_ratio']:6.2f} {med['before']['cpu_s']:10.1f} {med['after']['cpu_s']:9.1f}  "
              f"{same} (every repeat: {stable})", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
