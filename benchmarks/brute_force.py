"""Is the planner the optimum on small instances it was not tuned on? (issues 10, 13)

Random instances (6-9 layers, chains and DAGs, 1-2 nodes of up to 6 devices, slow and fast
links, memory from tight to generous; 1F1B, GPipe, ZB-H1 or auto; fixed or chosen microbatch
sizes), or with `--tp` smaller ones whose layers are also profiled at TP degree 2. Each is
planned (`planner.search.solve`, the default method) and solved by the brute force the tests
use (`tests/planner/cpsat_reference.py`: every split, placement, schedule and recomputation
set, judged by `evaluate()`). An instance whose brute force takes more than `--skip-s` is
skipped. A row is bad if the plan is slower than the optimum, its bound above it, or one side
finds a plan the other does not.

    PYTHONPATH=. .venv/bin/python benchmarks/brute_force.py --seeds 5000:5400 -o ROWS.json
    PYTHONPATH=. .venv/bin/python benchmarks/brute_force.py --seeds 9000:9300 --tp -o ROWS.json
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import signal
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.build import evaluate  # noqa: E402
from planner.cost import layer_table  # noqa: E402
from planner.errors import PipeplanError  # noqa: E402
from planner.formats import Cluster, PlanOptions, Profile  # noqa: E402
from planner.search import solve  # noqa: E402
from tests.planner.cpsat_reference import brute_force  # noqa: E402
from tests.planner.test_search import random_profile  # noqa: E402
from tests.planner.test_search_joint import coupled_instance, with_tp  # noqa: E402


def tp_instance(seed: int) -> tuple[Profile, Cluster, PlanOptions]:
    rng = random.Random(seed)
    profile = with_tp(random_profile(rng, rng.randint(3, 6), dag=rng.random() < 0.5), rng, (2,))
    cluster = Cluster(nodes=rng.randint(1, 2), devices_per_node=rng.choice([2, 3]),
                      device_memory_gb=rng.choice([1, 2, 4, 40]),
                      intra_node_gb_per_s=rng.choice([5, 50, 300]),
                      inter_node_gb_per_s=rng.choice([0.5, 5]), latency_us=rng.choice([0, 5]))
    schedule = rng.choice(["1f1b", "gpipe", "zb-h1", "auto"])
    b = rng.choice([2, 4])
    return profile, cluster, PlanOptions(global_batch=rng.choice([8, 16]), microbatch_size=b,
                                         optimizer=rng.choice(["sgd", "adam"]), time_limit_s=2,
                                         schedule=schedule)


class _Slow(Exception):
    pass


def _alarm(*_: object) -> None:
    raise _Slow


def check(seed: int, tp: bool, skip_s: int) -> dict | None:
    profile, cluster, options = tp_instance(seed) if tp else coupled_instance(seed)
    if cluster.num_devices > 6:
        return None
    sizes = options.microbatch_sizes or [options.microbatch_size]
    t0 = time.perf_counter()
    signal.alarm(skip_s)
    try:
        ref = brute_force(profile, cluster, options, sizes)
    except _Slow:
        return {"seed": seed, "skipped": True}
    finally:
        signal.alarm(0)
    brute_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        cand = solve(profile, cluster, options)
        concrete = options.model_copy(update={"schedule": cand.schedule or options.schedule,
                                              "microbatch_size": cand.microbatch_size,
                                              "microbatch_sizes": None})
        ev = evaluate(layer_table(profile), cluster, cand, concrete)
        got, bound, fits = ev.iteration_ms, float(cand.solver["bound"]), ev.fits  # type: ignore[arg-type]
    except PipeplanError:
        got, bound, fits = None, None, None
    plan_s = time.perf_counter() - t0
    optimum = ref.iteration_ms if ref.candidate is not None else None
    bad = []
    if optimum is None and got is not None and fits:
        bad.append("a plan the brute force does not find")
    if optimum is not None and got is None:
        bad.append("no plan")
    if optimum is not None and got is not None:
        if not fits:
            bad.append("does not fit")
        if got > optimum * (1 + 1e-9):
            bad.append(f"{100 * (got / optimum - 1):.2f} % slower than the optimum")
        if bound is not None and bound > optimum * (1 + 1e-9):
            bad.append("bound above the optimum")
    return {"seed": seed, "layers": len(profile.layers), "devices": cluster.num_devices,
            "schedule": options.schedule, "sizes": sizes, "optimum_ms": optimum, "planner_ms": got,
            "bound_ms": bound, "proven": optimum is not None and bound is not None
            and bound >= optimum * (1 - 1e-6), "brute_s": brute_s, "plan_s": plan_s, "bad": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="5000:5100", help="A:B, the seeds A .. B-1")
    ap.add_argument("--tp", action="store_true", help="layers also profiled at TP degree 2")
    ap.add_argument("--only", default="", help="schedules to keep, e.g. zb-h1,auto (default all)")
    ap.add_argument("--skip-s", type=int, default=90, help="skip an instance whose brute force takes longer")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks/results/brute_force.json"))
    args = ap.parse_args()
    signal.signal(signal.SIGALRM, _alarm)
    a, b = (int(x) for x in args.seeds.split(":"))
    only = {x for x in args.only.split(",") if x}
    rows = []
    print(f"{'seed':>6} {'L':>2} {'D':>2} {'schedule':8} {'optimum':>10} {'planner':>10} {'bound':>10}  bad")
    for seed in range(a, b):
        row = check(seed, args.tp, args.skip_s)
        if row is None or (only and row.get("schedule") not in only):
            continue
        rows.append(row)
        Path(args.output).write_text(json.dumps(rows, indent=1))
        if row.get("skipped"):
            print(f"{seed:6d} skipped (brute force over {args.skip_s} s)", flush=True)
            continue

        def f(x: float | None) -> str:
            return f"{x:10.3f}" if x is not None else f"{'-':>10}"
        print(f"{seed:6d} {row['layers']:2d} {row['devices']:2d} {row['schedule']:8} {f(row['optimum_ms'])} "
              f"{f(row['planner_ms'])} {f(row['bound_ms'])}  {'; '.join(row['bad'])}", flush=True)
    done = [r for r in rows if not r.get("skipped")]
    feasible = [r for r in done if r["optimum_ms"] is not None]
    print(f"\n{len(done)} instances ({len(rows) - len(done)} skipped), by schedule "
          f"{dict(collections.Counter(r['schedule'] for r in done))}; a plan exists on {len(feasible)}; "
          f"bad: {sum(1 for r in done if r['bad'])}; the plan's bound proves the optimum on "
          f"{sum(1 for r in feasible if r['proven'])} of {len(feasible)}")


if __name__ == "__main__":
    main()
