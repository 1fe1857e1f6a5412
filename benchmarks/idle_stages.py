"""Does leaving out stages that compute nothing lose plans? (issue 10)

The search and the bound leave out a stage whose layers take 0 ms (its devices would do no
work); since af1a78e the search allows one only where no plan without it fits memory. This
benchmark builds chains where many layers take 0 ms and hold gigabytes (parameters, or what
they save for the backward), plans each with the default method and solves it by the tests'
brute force (`tests/planner/cpsat_reference.py`, which allows such stages). It counts plans
slower than the optimum, "OPTIMAL" claims the brute force beats, and the plans found by the
search's second pass with 0-ms stages allowed (`solver.idle_stages`).

    PYTHONPATH=. .venv/bin/python benchmarks/idle_stages.py --seeds 0:200 -o ROWS.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.errors import PipeplanError  # noqa: E402
from planner.formats import Cluster, PlanOptions, Profile  # noqa: E402
from planner.search import solve  # noqa: E402
from tests.planner.cpsat_reference import brute_force  # noqa: E402
from tests.planner.helpers import chain_profile, cluster  # noqa: E402


def instance(seed: int) -> tuple[Profile, Cluster, PlanOptions]:
    """3-6 layers, about a third of them 0 ms; 2-4 devices of 2-16 GB."""
    rng = random.Random(seed)
    n = rng.randint(3, 6)
    fwd = [0.0 if rng.random() < 0.35 else rng.uniform(1, 20) for _ in range(n)]
    if all(f == 0 for f in fwd):
        fwd[0] = 5.0
    params = [rng.choice([10**7, 10**8, 10**9, 3 * 10**9]) for _ in range(n)]
    act = [rng.choice([10**6, 10**8, 10**9, 3 * 10**9]) for _ in range(n)]
    devices = rng.randint(2, 4)
    memory = rng.choice([2.0, 4.0, 6.0, 8.0, 16.0])
    options = PlanOptions(global_batch=32, microbatch_size=8, optimizer=rng.choice(["sgd", "adam"]),
                          schedule=rng.choice(["1f1b", "gpipe", "zb-h1"]), time_limit_s=2)
    return chain_profile(fwd, params=params, act=act, out=[10**6] * n), cluster(per_node=devices, memory_gb=memory), options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0:200", help="A:B, the seeds A .. B-1")
    ap.add_argument("-o", "--output", default="idle_stages.json")
    args = ap.parse_args()
    a, b = map(int, args.seeds.split(":"))
    rows = []
    print(f"{'seed':>5} {'L':>2} {'D':>2} {'0ms':>3} {'optimum':>10} {'planner':>10} status    second-pass")
    for seed in range(a, b):
        profile, cl, options = instance(seed)
        ref = brute_force(profile, cl, options, [options.microbatch_size or 8])
        try:
            c = solve(profile, cl, options)
            got, status, idle = float(c.solver["objective"]), str(c.solver["status"]), bool(c.solver.get("idle_stages"))
        except PipeplanError:
            got, status, idle = None, "none", False
        opt = ref.iteration_ms if ref.candidate is not None else None
        slower = got is not None and opt is not None and got > opt * (1 + 1e-9)
        row = {"seed": seed, "layers": len(profile.layers), "devices": cl.num_devices,
               "zero_ms_layers": sum(layer.fwd_ms + layer.bwd_ms == 0 for layer in profile.layers),
               "optimum_ms": opt, "planner_ms": got, "status": status, "idle_stages": idle,
               "slower": slower, "one_side_only": (opt is None) != (got is None),
               "wrong_optimal": slower and status == "OPTIMAL"}
        rows.append(row)
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"{seed:>5} {row['layers']:>2} {row['devices']:>2} {row['zero_ms_layers']:>3} {fmt(opt):>10} "
              f"{fmt(got):>10} {status:<9} {'yes' if idle else ''}"
              + ("  SLOWER" if slower else "") + ("  ONE SIDE" if row["one_side_only"] else ""), flush=True)
    Path(args.output).write_text(json.dumps(rows, indent=1))
    n_plan = sum(r["optimum_ms"] is not None for r in rows)
    print(f"\n{len(rows)} instances; a plan exists on {n_plan}; the planner has one on "
          f"{sum(r['planner_ms'] is not None for r in rows)}; found by the second pass "
          f"{sum(r['idle_stages'] for r in rows)}; slower than the optimum {sum(r['slower'] for r in rows)} "
          f"(OPTIMAL claimed on {sum(r['wrong_optimal'] for r in rows)}); a plan on one side only "
          f"{sum(r['one_side_only'] for r in rows)}")


if __name__ == "__main__":
    main()
