"""How good are the planner's plans? Against an independent randomized search and every
baseline, on real GPU profiles, the bundled examples and synthetic chains, on slow and fast
clusters, with generous and tight memory, fixed and chosen microbatch sizes (issue 10).

For each instance: the planner's (method cpsat) predicted iteration time, proven bound, gap
and wall time; whether a second run (optionally while another process keeps both cores busy)
gives the same plan; whether a stage that computes nothing has devices of its own; the best
plan of a randomized search implemented here (it calls `evaluate()`, never the planner): random
splits, replicas and microbatch sizes on consecutive ranks, each improved by hill climbing on
boundaries and replicas, for `--rs-seconds`; and the baselines uniform, params, blocks,
pipedream. Prints a table and writes benchmarks/results/plan_quality.json.

    .venv/bin/python benchmarks/plan_quality.py [--rs-seconds 60] [--only gnmt,chain100]
        [--clusters slow16,hier4x4,fast2x8,fast16x8] [--memory generous,tight]
        [--microbatch fixed,chosen] [--loaded-rerun] [--schedule 1f1b] [--schedules zb-h1,gpipe,auto]
        [--planned results.json]   # the planner's figures from an earlier run: random search only
        [--planner-only]           # one plan per instance, nothing else: A/B of two planner trees

With `--schedules`, each instance is also planned with those schedules (the planner only):
`auto` must never predict worse than the best fixed schedule, and the summary counts which
schedule it picks.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path
from typing import NoReturn

# keep benchmarks/ off sys.path so no script name here can shadow a package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from planner.build import evaluate  # noqa: E402
from planner.cost import layer_table, microbatch_scale, stage_memory_bytes  # noqa: E402
from planner.errors import PipeplanError  # noqa: E402
from planner.formats import Cluster, PlanOptions, Profile  # noqa: E402
from planner.importers.pipedream import import_pipedream_file  # noqa: E402
from planner.io import load_model  # noqa: E402
from planner.partition import Candidate, StageChoice  # noqa: E402
from planner.search.bound import conditions, feasible  # noqa: E402
from planner.solve import make_plan  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = Path(os.environ.get("PIPEPLAN_PIPEDREAM_PROFILES",
                               ROOT.parent / "shared" / "data" / "pipedream-profiles"))
CLUSTERS = {
    "slow16": dict(nodes=16, devices_per_node=1, intra_node_gb_per_s=1, inter_node_gb_per_s=1),
    "hier4x4": dict(nodes=4, devices_per_node=4, intra_node_gb_per_s=10, inter_node_gb_per_s=1),
    "fast2x8": dict(nodes=2, devices_per_node=8, intra_node_gb_per_s=300, inter_node_gb_per_s=25),
    "fast16x8": dict(nodes=16, devices_per_node=8, intra_node_gb_per_s=300, inter_node_gb_per_s=25),
}
BASELINES = ["uniform", "params", "blocks", "pipedream"]
MICROBATCHES = 16  # global batch = 16 x the profile's batch size


def chain_profile(num_layers: int, seed: int = 0) -> Profile:
    """A synthetic chain with uneven layers (times 0.05-0.35 ms, 2-20 MB of parameters)."""
    rng = random.Random(seed)
    layers = [dict(name=f"layer{i}", fwd_ms=rng.uniform(0.05, 0.15), bwd_ms=rng.uniform(0.1, 0.2),
                   param_bytes=int(rng.uniform(2e6, 2e7)), activation_bytes=int(rng.uniform(1e7, 4e7)),
                   output_bytes=int(4e6)) for i in range(num_layers)]
    return Profile(model={"path": f"synthetic-chain-{num_layers}", "sha256": "0"},
                   device={"type": "gpu", "name": "synthetic"}, batch_size=4, layers=layers)


def profiles(only: list[str] | None) -> dict[str, Profile]:
    out: dict[str, Profile] = {}
    for path in sorted(PROFILES.glob("*.txt")):
        if path.stem.upper().startswith("LICENSE"):
            continue
        out[path.stem] = import_pipedream_file(path, 64 if path.stem.startswith("gnmt") else 128)
    for path in sorted((ROOT / "benchmarks/results/planner_profiles").glob("*.json")):
        out[f"example_{path.stem}"] = load_model(path, Profile)
    for n in (100, 200, 1000):
        out[f"chain{n}"] = chain_profile(n)
    return {k: v for k, v in out.items() if not only or k in only}


def with_optimizer_steps(profile: Profile, ms_per_gb: float) -> Profile:
    """`profile` with an SGD step of `ms_per_gb` per GB of trained parameters on every layer
    that has none (PipeDream's profiles do not measure it)."""
    layers = [x if x.optimizer_ms else x.model_copy(update={"optimizer_ms": {
        "sgd": ms_per_gb * (x.param_bytes - (x.frozen_param_bytes or 0)) / 1e9}}) for x in profile.layers]
    return profile.model_copy(update={"layers": layers})


def least_memory_gb(profile: Profile, cluster: dict, options: PlanOptions, b: int) -> float:
    """The least device memory at which the planner's memory conditions admit some plan
    (bisection over the DP's feasibility at unlimited time, 1F1B's memory whatever the
    schedule, so every schedule plans the same instance): no 1F1B plan fits below it."""
    table = layer_table(profile)
    lo, hi = 1e-3, 1e4
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        cl = Cluster(**cluster, device_memory_gb=mid)
        c = conditions(table, cl, options.optimizer, "1f1b", options.global_batch, b)
        if feasible(c, math.inf):
            hi = mid
        else:
            lo = mid
        if hi / lo < 1.001:
            break
    return hi


# The least memory of each tight instance, kept between runs: its bisection runs the DP some
# twenty times, minutes for the largest profiles on 128 devices (nasnetalarge, chain1000)
LEAST_MEMORY_CACHE = ROOT / "benchmarks/results/plan_quality_least_memory.json"


def cached_least_memory(cache: dict[str, float], pname: str, cname: str, profile: Profile,
                        options: PlanOptions, b: int) -> float:
    key = f"{pname}/{cname}/{options.optimizer}/{options.global_batch}/{b}"
    if key not in cache:
        cache[key] = least_memory_gb(profile, CLUSTERS[cname], options, b)
    return cache[key]


# ---------------------------------------------------------------- the independent search


def _candidate(bounds: list[int], reps: list[int], b: int, m: int,
               recompute: frozenset[int] = frozenset()) -> Candidate:
    stages, rank = [], 0
    for k, (a, z, r) in enumerate(zip(bounds, bounds[1:], reps, strict=False)):
        stages.append(StageChoice(a, z, tuple(range(rank, rank + r)), recompute=k in recompute))
        rank += r
    return Candidate(tuple(stages), b, m)


def random_search(profile: Profile, cluster: Cluster, options: PlanOptions, sizes: list[int],
                  seconds: float, seed: int = 0, allow_idle: bool = False) -> dict:
    """Random (split, replicas, microbatch size) on consecutive ranks + hill climbing, judged by
    `evaluate()`. With `allow_idle` False, a stage that computes nothing is not allowed. A
    split that overflows memory is scored once more with recomputation on the stages that
    overflow (where the options allow it): on tight memory most plans need it; a random start
    that still overflows is repaired by splitting its most overflowing stage (`repair`). Half
    the starts lay their boundaries to fit memory (`packed`), the others are uniform."""
    table = layer_table(profile)
    L, D = table.num_layers, cluster.num_devices
    rng = random.Random(seed)
    best = (math.inf, None)
    evals = 0

    def judge(bounds: list[int], reps: list[int], b: int):
        nonlocal evals
        if not allow_idle and any(table.compute_ms(a, z) <= 0 for a, z in zip(bounds, bounds[1:], strict=False)):
            return None
        evals += 1
        m = options.global_batch // b
        ev = evaluate(table, cluster, _candidate(bounds, reps, b, m), options)
        if not ev.fits and options.allow_recompute:
            over = frozenset(k for k, (need, lim) in enumerate(
                zip(ev.stage_memory_bytes, ev.costs.memory_limit_bytes, strict=True)) if need > lim)
            evals += 1
            ev = evaluate(table, cluster, _candidate(bounds, reps, b, m, over), options)
        return ev

    def score(bounds: list[int], reps: list[int], b: int) -> float:
        ev = judge(bounds, reps, b)
        return ev.iteration_ms if ev is not None and ev.fits else math.inf

    def repair(bounds: list[int], reps: list[int], b: int) -> tuple[list[int], list[int], float]:
        """Where a random plan overflows memory (tight rows: nearly every one does), split
        its most overflowing stage at a random layer, the new stage on a free device or on a
        replica taken from the most replicated stage, until it fits or cannot split."""
        for _ in range(2 * D):
            ev = judge(bounds, reps, b)
            if ev is None:
                return bounds, reps, math.inf
            if ev.fits:
                return bounds, reps, ev.iteration_ms
            ratio = [need / lim for need, lim in zip(ev.stage_memory_bytes, ev.costs.memory_limit_bytes,
                                                      strict=True)]
            k = max((x for x in range(len(reps)) if bounds[x + 1] - bounds[x] >= 2),
                    key=lambda x: ratio[x], default=None)
            if k is None or ratio[k] <= 1:
                return bounds, reps, math.inf
            reps = list(reps)
            if sum(reps) >= D:
                most = max(range(len(reps)), key=lambda x: reps[x])
                if reps[most] < 2:
                    return bounds, reps, math.inf
                reps[most] -= 1
            cut = rng.randint(bounds[k] + 1, bounds[k + 1] - 1)
            bounds = bounds[:k + 1] + [cut] + bounds[k + 1:]
            reps = reps[:k + 1] + [1] + reps[k + 1:]
        return bounds, reps, math.inf

    limit = min(d.memory_bytes for d in cluster.devices())

    def packed(b: int) -> list[int] | None:
        """Random boundaries laid from the last layer back, each stage at most as long as fits
        memory with 1F1B's in-flight microbatches at one replica per stage (one more per stage
        after it), biased to the longest: on tight memory, uniform cuts almost never fit."""
        scale, m = microbatch_scale(table.batch_size, b), options.global_batch // b
        bounds, j = [L], L
        while j > 0:
            inflight = min(m, len(bounds))
            i = j - 1
            while i > 0 and stage_memory_bytes(table.param_bytes(i - 1, j), table.activation_bytes(i - 1, j),
                                               scale, inflight, options.optimizer) <= limit:
                i -= 1
            j = i + int(rng.random() ** 3 * (j - 1 - i))
            bounds.append(j)
        return bounds[::-1] if len(bounds) - 1 <= D else None

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        b = rng.choice(sizes)
        S = rng.randint(1, min(L, D, rng.choice([4, 8, 16, 32, 64])))
        bounds = [0, *sorted(rng.sample(range(1, L), S - 1)), L]
        if rng.random() < 0.5 and (got := packed(b)) is not None:
            bounds, S = got, len(got) - 1
        reps = [1] * S
        for _ in range(rng.randint(0, D - S)):
            reps[rng.randrange(S)] += 1
        bounds, reps, cur = repair(bounds, reps, b)
        if not math.isfinite(cur):
            continue
        improved = True
        while improved and time.perf_counter() - t0 < seconds:
            improved = False
            moves = []
            for k in range(1, len(bounds) - 1):
                for d in (-4, -1, 1, 4):
                    nb = list(bounds)
                    nb[k] += d
                    if nb[k - 1] < nb[k] < nb[k + 1]:
                        moves.append((nb, reps))
            for k in range(len(reps)):
                if reps[k] > 1:
                    for t in range(len(reps)):
                        if t != k:
                            nr = list(reps)
                            nr[k] -= 1
                            nr[t] += 1
                            moves.append((bounds, nr))
            for nb, nr in moves:
                v = score(nb, nr, b)
                if v < cur * (1 - 1e-12):
                    bounds, reps, cur, improved = nb, nr, v, True
                    break
        if cur < best[0]:
            best = (cur, (bounds, reps, b))
    out = {"iteration_ms": best[0] if math.isfinite(best[0]) else None, "evaluations": evals}
    if best[1] is not None:
        out.update(bounds=best[1][0], replicas=best[1][1], microbatch_size=best[1][2])
    return out


# ---------------------------------------------------------------- one instance


def _busy(stop) -> None:  # pragma: no cover - a load generator
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1000003


def plan_key(plan) -> list:
    return [(s.layers[0], s.layers[-1], s.replicas, s.devices) for s in plan.stages] + \
        [plan.microbatch_size]


def schedule_rows(profile: Profile, cluster: Cluster, options: PlanOptions,
                  schedules: list[str]) -> dict:
    """The planner's plan under each schedule: predicted ms, bound, and auto's pick."""
    out: dict = {}
    for name in schedules:
        t0 = time.perf_counter()
        try:
            plan = make_plan(profile, cluster, options.model_copy(update={"schedule": name}))
        except PipeplanError:
            out[name] = None
            continue
        out[name] = {"ms": plan.predicted.iteration_ms, "bound_ms": plan.solver.bound,
                     "picked": plan.schedule, "wall_s": time.perf_counter() - t0,
                     "recomputed_stages": sum(s.recompute for s in plan.stages)}
    return out


PLANNER_FIELDS = ("planner_ms", "bound_ms", "gap", "status", "wall_s", "stages", "used_devices",
                  "microbatch_size", "idle_stages", "rerun_wall_s", "same_plan_on_rerun",
                  "same_bound_on_rerun", "planner_error")


class _Planned(Exception):
    """The planner's figures come from an earlier run (`--planned`)."""


def run_instance(name: str, profile: Profile, cluster: Cluster, options: PlanOptions,
                 sizes: list[int], rs_seconds: float, loaded_rerun: bool,
                 planned: dict | None = None, planner_only: bool = False) -> dict:
    """One row; with `planned` (a row of an earlier run's results) the planner's figures are
    taken from it instead of planning again (the random search and baselines still run); with
    `planner_only`, one plan and nothing else (no rerun, no baselines, no random search)."""
    table = layer_table(profile)
    row: dict = {"instance": name, "layers": table.num_layers, "devices": cluster.num_devices}
    t0 = time.perf_counter()
    if planned is not None:
        row.update({k: planned[k] for k in PLANNER_FIELDS if k in planned})
    try:
        if planned is not None:
            raise _Planned
        plan = make_plan(profile, cluster, options)
        wall = time.perf_counter() - t0
        idle = [s.index for s in plan.stages if s.predicted.compute_ms <= 0]
        row.update(planner_ms=plan.predicted.iteration_ms, bound_ms=plan.solver.bound,
                   gap=plan.solver.gap, status=plan.solver.status, wall_s=wall,
                   stages=len(plan.stages), used_devices=sum(s.replicas for s in plan.stages),
                   microbatch_size=plan.microbatch_size, idle_stages=idle)
        if planner_only:
            return row
        stop = None
        procs = []
        if loaded_rerun:
            stop = mp.Event()
            procs = [mp.Process(target=_busy, args=(stop,)) for _ in range(2)]
            for p in procs:
                p.start()
        t1 = time.perf_counter()
        try:
            again = make_plan(profile, cluster, options)
            row["rerun_wall_s"] = time.perf_counter() - t1
        finally:
            if stop is not None:
                stop.set()
                for p in procs:
                    p.join()
        row["same_plan_on_rerun"] = plan_key(again) == plan_key(plan) and \
            again.predicted.iteration_ms == plan.predicted.iteration_ms
        row["same_bound_on_rerun"] = again.solver.bound == plan.solver.bound
    except _Planned:
        pass
    except PipeplanError as exc:
        row.update(planner_error=str(exc), wall_s=time.perf_counter() - t0)
    for method in BASELINES:
        try:
            bp = make_plan(profile, cluster, options.model_copy(update={"method": method,
                                                                        "microbatch_sizes": None}))
            row[method] = bp.predicted.iteration_ms
        except PipeplanError:
            row[method] = None
    if rs_seconds > 0:
        rs = random_search(profile, cluster, options, sizes, rs_seconds)
        row["random"] = rs["iteration_ms"]
        row["random_evaluations"] = rs["evaluations"]
        if rs.get("bounds") is not None:  # so a plan that beats the planner can be checked again
            row["random_plan"] = {k: rs[k] for k in ("bounds", "replicas", "microbatch_size")}
    best_other = min((v for k in BASELINES + ["random"] if (v := row.get(k)) is not None),
                     default=None)
    row["best_other"] = best_other
    if best_other is not None and row.get("planner_ms") is not None:
        row["planner_vs_best_other"] = row["planner_ms"] / best_other - 1
    return row


def no_instance(only: list[str]) -> NoReturn:
    """Nothing to plan: say why on stderr and exit 2 (no results file is written)."""
    print(f"plan_quality: no instance matched (--only {','.join(only) or '(all)'}; PipeDream "
          f"profiles looked for in {PROFILES}, set PIPEPLAN_PIPEDREAM_PROFILES to move them)",
          file=sys.stderr)
    raise SystemExit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="")
    ap.add_argument("--clusters", default=",".join(CLUSTERS))
    ap.add_argument("--memory", default="generous,tight")
    ap.add_argument("--microbatch", default="fixed,chosen")
    ap.add_argument("--rs-seconds", type=float, default=60.0)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--loaded-rerun", action="store_true",
                    help="rerun each plan while two busy processes load both cores")
    ap.add_argument("--schedule", default="1f1b",
                    help="the planner's schedule for the main plan (1f1b, zb-h1, gpipe, auto)")
    ap.add_argument("--schedules", default="",
                    help="also plan with these schedules (e.g. zb-h1,gpipe,auto)")
    ap.add_argument("--optimizer-step-ms-per-gb", type=float, default=0.0,
                    help="give every layer without a measured optimizer step an SGD step of this "
                         "many ms per GB of its parameters (e.g. 1.5: SGD reads parameter and "
                         "gradient and writes the parameter, 12 bytes per float at 2 TB/s); 0: none")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks/results/plan_quality.json"))
    ap.add_argument("--planned", default="",
                    help="results JSON of an earlier run: take the planner's figures from its rows "
                         "instead of planning again (the random search and baselines run)")
    ap.add_argument("--planner-only", action="store_true",
                    help="plan each instance once and nothing else (no rerun, baselines or random "
                         "search): an A/B of two planner trees in half the time")
    ap.add_argument("--memory-cache", default=str(LEAST_MEMORY_CACHE),
                    help="JSON of the tight instances' least memory, read and extended ('' for none)")
    args = ap.parse_args()
    cache_path = Path(args.memory_cache) if args.memory_cache else None
    cache: dict[str, float] = json.loads(cache_path.read_text()) \
        if cache_path is not None and cache_path.exists() else {}
    cached = len(cache)
    only = [x for x in args.only.split(",") if x]
    planned = {r["instance"]: r for r in json.loads(Path(args.planned).read_text())} if args.planned else {}
    todo = profiles(only)
    if not todo:
        no_instance(only)
    rows = []
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    head = (f"{'instance':34} {'L':>5} {'D':>4} {'planner':>10} {'bound':>10} {'gap%':>6} "
            f"{'wall':>5} {'random':>10} {'best base':>10} {'vs best%':>8} same idle")
    print(head)
    for pname, profile in todo.items():
        if args.optimizer_step_ms_per_gb > 0:
            profile = with_optimizer_steps(profile, args.optimizer_step_ms_per_gb)
        B0 = profile.batch_size
        for cname in args.clusters.split(","):
            for mem in args.memory.split(","):
                for mb in args.microbatch.split(","):
                    gb = MICROBATCHES * B0
                    sizes = [B0] if mb == "fixed" else \
                        sorted({max(1, B0 // 4), max(1, B0 // 2), B0, 2 * B0})
                    base = PlanOptions(global_batch=gb, optimizer="sgd", time_limit_s=args.time_limit,
                                       schedule=args.schedule,
                                       **({"microbatch_size": B0} if mb == "fixed" else
                                          {"microbatch_sizes": sizes}))
                    if mem == "generous":
                        gbytes = 80.0
                    else:
                        gbytes = 1.2 * min(cached_least_memory(cache, pname, cname, profile, base, b)
                                           for b in sizes)
                    cluster = Cluster(**CLUSTERS[cname], device_memory_gb=gbytes)
                    name = f"{pname}/{cname}/{mem}/{mb}"
                    if args.planned and name not in planned:
                        continue
                    row = run_instance(name, profile, cluster, base, sizes, args.rs_seconds,
                                       args.loaded_rerun, planned.get(name), args.planner_only)
                    row.update(profile=pname, cluster=cname, memory=mem, microbatch=mb,
                               device_memory_gb=gbytes)
                    if args.schedules:
                        row["schedules"] = schedule_rows(profile, cluster, base,
                                                         [x for x in args.schedules.split(",") if x])
                        row["schedules"]["1f1b"] = row["schedules"].get("1f1b") or (
                            {"ms": row["planner_ms"], "bound_ms": row["bound_ms"]}
                            if row.get("planner_ms") is not None else None)
                    rows.append(row)
                    out.write_text(json.dumps(rows, indent=1))
                    if cache_path is not None and len(cache) > cached:  # only when it grew
                        cache_path.write_text(json.dumps(dict(sorted(cache.items())), indent=1))
                        cached = len(cache)

                    def f(x: object, fmt: str = "10.2f") -> str:
                        return format(x, fmt) if isinstance(x, float) else format(str(x), ">" + fmt.split(".")[0])
                    base_best = min((v for k in BASELINES if (v := row.get(k)) is not None),
                                    default=None)
                    print(f"{name:34} {row['layers']:5d} {row['devices']:4d} "
                          f"{f(row.get('planner_ms', 'error'))} {f(row.get('bound_ms'))} "
                          f"{f(100 * row['gap'] if row.get('gap') is not None else None, '6.2f')} "
                          f"{f(row['wall_s'], '5.1f')} {f(row.get('random'))} {f(base_best)} "
                          f"{f(100 * row['planner_vs_best_other'] if 'planner_vs_best_other' in row else None, '8.2f')} "
                          f"{str(row.get('same_plan_on_rerun', '-')):>4} {len(row.get('idle_stages', []))}",
                          flush=True)
    if not rows:  # e.g. --planned naming none of these instances
        no_instance(only)
    summarize(rows)


def summarize(rows: list[dict]) -> None:
    n = len(rows)
    solved = [r for r in rows if r.get("planner_ms") is not None]
    gap1 = [r for r in solved if r["gap"] is not None and r["gap"] <= 0.01]
    beaten = [r for r in solved if r.get("planner_vs_best_other", -1) > 0.001]
    same = [r for r in solved if r.get("same_plan_on_rerun")]
    same_bound = [r for r in solved if r.get("same_bound_on_rerun")]
    idle = [r for r in solved if r.get("idle_stages")]
    missing = [r for r in rows if r.get("planner_ms") is None and r.get("best_other") is not None]
    print(f"\n{n} instances: plan found {len(solved)}; gap <= 1 %: {len(gap1)} "
          f"({100 * len(gap1) / max(n, 1):.0f} %); beaten by > 0.1 %: {len(beaten)}; "
          f"same plan on rerun: {len(same)} (same bound: {len(same_bound)}); with a 0-ms stage: {len(idle)}; no plan where another "
          f"method found one: {len(missing)}")
    for r in beaten:
        print(f"  beaten: {r['instance']}: planner {r['planner_ms']:.2f} vs {r['best_other']:.2f}")
    with_auto = [r for r in rows if (r.get("schedules") or {}).get("auto")]
    if with_auto:
        picks: dict[str, int] = {}
        worse = []
        for r in with_auto:
            sch = r["schedules"]
            picks[sch["auto"]["picked"]] = picks.get(sch["auto"]["picked"], 0) + 1
            fixed = [v["ms"] for k, v in sch.items() if k != "auto" and v]
            if fixed and sch["auto"]["ms"] > min(fixed) * (1 + 1e-9):
                worse.append((r["instance"], sch["auto"]["ms"], min(fixed)))
        print(f"--schedule auto on {len(with_auto)} instances: picks {picks}; worse than the best "
              f"fixed schedule on {len(worse)}")
        for name, a, f in worse:
            print(f"  auto worse: {name}: {a:.2f} vs {f:.2f}")


if __name__ == "__main__":
    main()
