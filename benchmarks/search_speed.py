"""How fast does the search score a candidate? (issue 10: the budget is work, so a faster
evaluation is a plan sooner, never another plan.)

For each instance, the candidates a short planner run scores (captured as it scores them),
evaluated three ways side by side, best of `--repeats` passes each:
- `full`: `evaluate()` with the simulation's events recorded (what a plan.json is built from);
- `as it comes`: without events, each schedule simulated by `simulate_costs`' dependency walk
  (the search's scoring before schedule shapes were kept);
- `kept shape`: without events, each schedule shape's dependency order kept between
  candidates (`simulator.simulate_generated`; the passes after the first, as in a search that
  meets a shape again);
and whether the three agree to the bit; the cost model (`pipeline_costs`) for the same
candidates with and without the search's per-stage cache (a fresh one, filled in the order the
search scored them), and whether the two agree to the bit. Also the plan's own wall time with the garbage
collector at Python's default threshold against the search's (`search.GC_THRESHOLD`).
Prints a table and writes benchmarks/results/search_speed.json.

    .venv/bin/python benchmarks/search_speed.py [--only chain100/slow16/generous,...]
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import planner.build as build  # noqa: E402
import planner.search as search  # noqa: E402
import planner.search.space as space  # noqa: E402
from planner.cost import layer_table  # noqa: E402
from planner.formats import Cluster, PlanOptions  # noqa: E402
from planner.schedules import generate, memory_representatives  # noqa: E402
from planner.simulator import simulate_costs, simulate_generated  # noqa: E402
from planner.solve import make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("plan_quality", ROOT / "benchmarks/plan_quality.py")
assert _spec is not None and _spec.loader is not None
plan_quality = importlib.util.module_from_spec(_spec)  # its instances: the same suite
_spec.loader.exec_module(plan_quality)
CLUSTERS, LEAST_MEMORY_CACHE = plan_quality.CLUSTERS, plan_quality.LEAST_MEMORY_CACHE
MICROBATCHES, profiles = plan_quality.MICROBATCHES, plan_quality.profiles

DEFAULT = ("chain100/slow16/generous,gnmt/hier4x4/generous,resnet50/fast2x8/tight,"
           "chain200/fast16x8/tight,example_gpt/fast2x8/tight/zb-h1")


def instance(spec: str) -> tuple:
    name, cname, mem, *rest = spec.split("/")
    schedule = rest[0] if rest else "1f1b"
    profile = profiles([name])[name]
    b = profile.batch_size
    least = json.loads(LEAST_MEMORY_CACHE.read_text())
    gb = 80.0 if mem == "generous" else 1.2 * least[f"{name}/{cname}/sgd/{MICROBATCHES * b}/{b}"]
    cluster = Cluster(**CLUSTERS[cname], device_memory_gb=gb)
    options = PlanOptions(global_batch=MICROBATCHES * b, optimizer="sgd", time_limit_s=10.0,
                          schedule=schedule, microbatch_size=b)
    return profile, cluster, options


def best_of(fn, repeats: int) -> float:
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out = min(out, time.perf_counter() - t0)
    return out


def captured(profile, cluster, options: PlanOptions) -> list:
    """The candidates a 2 s plan scores, in order."""
    cands = []
    scored = space.evaluate

    def capture(table, cl, cand, opts, devices=None, record=True, stage_cache=None):
        cands.append(cand)
        return scored(table, cl, cand, opts, devices, record, stage_cache)

    space.evaluate = capture
    try:
        make_plan(profile, cluster, options.model_copy(update={"time_limit_s": 2.0}))
    finally:
        space.evaluate = scored
    return cands


def plan_seconds(profile, cluster, options: PlanOptions, threshold: int) -> float:
    saved = search.GC_THRESHOLD
    search.GC_THRESHOLD = threshold
    gc.collect()
    try:
        t0 = time.perf_counter()
        make_plan(profile, cluster, options)
        return time.perf_counter() - t0
    finally:
        search.GC_THRESHOLD = saved


def measure(spec: str, repeats: int) -> dict:
    profile, cluster, options = instance(spec)
    cands = captured(profile, cluster, options)
    table, devs = layer_table(profile), cluster.devices()
    costs = [build.pipeline_costs(table, cluster, c, options.optimizer, devs) for c in cands]

    def cached_costs() -> list:  # a fresh cache, filled in the order the search scored them
        kept_stages: dict = {}
        return [build.pipeline_costs(table, cluster, c, options.optimizer, devs, kept_stages) for c in cands]

    t_costs = best_of(lambda: [build.pipeline_costs(table, cluster, c, options.optimizer, devs) for c in cands],
                      repeats)
    t_cached = best_of(cached_costs, repeats)
    same_costs = cached_costs() == costs
    name = options.schedule
    deferred = [build.schedule_deferrals(k, name) for k in costs]
    full = [lambda c=c: build.evaluate(table, cluster, c, options, devs) for c in cands]
    plain = [lambda k=k, d=d: simulate_costs(
        k, generate(name, k.stage_devices, k.num_microbatches, d), False,
        memory_representatives(k.stage_devices, k.num_microbatches)) for k, d in zip(costs, deferred, strict=True)]
    kept = [lambda k=k, d=d: simulate_generated(k, name, d) for k, d in zip(costs, deferred, strict=True)]
    for _ in range(2):  # every shape met once (simulated as it comes), then made
        for f in kept:
            f()
    t_full = best_of(lambda: [f() for f in full], repeats)
    t_plain = best_of(lambda: [f() for f in plain], repeats)
    t_kept = best_of(lambda: [f() for f in kept], repeats)
    same = all((x.iteration_ms, x.busy_ms, x.idle_ms, x.peak_memory_bytes, x.peak_inflight)
               == (y.iteration_ms, y.busy_ms, y.idle_ms, y.peak_memory_bytes, y.peak_inflight)
               for x, y in ((a(), b()) for a, b in zip(plain, kept, strict=True)))
    n = len(cands)
    return {"instance": spec, "candidates": n, "full_us": 1e6 * t_full / n,
            "as_it_comes_us": 1e6 * t_plain / n, "kept_shape_us": 1e6 * t_kept / n,
            "speedup": t_plain / t_kept, "same_to_the_bit": same,
            "costs_us": 1e6 * t_costs / n, "costs_stage_cache_us": 1e6 * t_cached / n,
            "costs_speedup": t_costs / t_cached, "costs_same_to_the_bit": same_costs,
            "plan_s": {"gc_default": plan_seconds(profile, cluster, options, 700),
                       "gc_search": plan_seconds(profile, cluster, options, search.GC_THRESHOLD)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=DEFAULT)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks/results/search_speed.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'instance':36} {'cands':>6} {'full us':>8} {'as it comes':>11} {'kept shape':>10} "
          f"{'speedup':>7} {'same':>5} {'costs us':>8} {'stage cache':>11} {'speedup':>7} {'same':>5} "
          f"{'plan s, gc default':>18} {'gc 50k':>7}")
    for spec in args.only.split(","):
        row = measure(spec, args.repeats)
        rows.append(row)
        print(f"{spec:36} {row['candidates']:6d} {row['full_us']:8.0f} {row['as_it_comes_us']:11.0f} "
              f"{row['kept_shape_us']:10.0f} {row['speedup']:7.2f} {str(row['same_to_the_bit']):>5} "
              f"{row['costs_us']:8.0f} {row['costs_stage_cache_us']:11.0f} {row['costs_speedup']:7.2f} "
              f"{str(row['costs_same_to_the_bit']):>5} "
              f"{row['plan_s']['gc_default']:18.2f} {row['plan_s']['gc_search']:7.2f}", flush=True)
    Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
