"""How good and how fast is each planning method? Every registered method (cpsat included when
`planner.cpsat` exists) on the examples' profiles, PipeDream's GPU profiles (vgg16, resnet50,
gnmt, gnmt_large) and a synthetic 1000-layer chain, for clusters of 1x8, 4x8 and 16x8 devices
and one with tight memory. Prints a table and writes benchmarks/results/plan_methods.json.

    .venv/bin/python benchmarks/plan_methods.py [--time-limit 10] [--only vgg16,chain1000] [--quick]

Columns: method, wall seconds, predicted iteration ms (simulator), throughput, ratio to the
lower bound, peak memory per device against the limit. Methods that find no plan that fits say
so (with the memory they would need).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from planner.errors import PipeplanError  # noqa: E402
from planner.formats import GB, INPUT_NODE, Cluster, PlanOptions, Profile  # noqa: E402
from planner.importers.pipedream import import_pipedream_file  # noqa: E402
from planner.io import load_model  # noqa: E402
from planner.solve import METHODS, compare  # noqa: E402

PIPEDREAM = Path(os.environ.get("PIPEPLAN_PIPEDREAM_PROFILES",
                               ROOT.parent / "shared" / "data" / "pipedream-profiles"))
RESULTS = ROOT / "benchmarks" / "results"
PROFILE_CACHE = RESULTS / "planner_profiles"
# PipeDream's files do not record their batch size; vgg16's input size says 128 for the image
# models; for GNMT we assume 64.
IMPORTED = {"vgg16": 128, "resnet50": 128, "gnmt": 64, "gnmt_large": 64}
EXAMPLES = ["mlp", "gpt", "unet"]


def cluster(nodes: int, memory_gb: float = 80.0) -> Cluster:
    return Cluster(nodes=nodes, devices_per_node=8, device_memory_gb=memory_gb,
                   intra_node_gb_per_s=300.0, inter_node_gb_per_s=25.0, latency_us=5.0)


CLUSTERS = {"1x8": cluster(1), "4x8": cluster(4), "16x8": cluster(16), "4x8-tight": cluster(4, 2.0)}


def synthetic_chain(n: int = 1000, seed: int = 0) -> Profile:
    """A 1000-layer chain with uneven layers (a few 10x heavier), batch 8."""
    rng = random.Random(seed)
    layers, edges = [], [{"src": INPUT_NODE, "dst": "l0", "bytes": 8 * 4096}]
    for i in range(n):
        f = rng.uniform(0.05, 0.5) * (10 if rng.random() < 0.02 else 1)
        layers.append({"name": f"l{i}", "fwd_ms": f, "bwd_ms": 2 * f,
                       "param_bytes": rng.choice([0, rng.randint(10**5, 4 * 10**7)]),
                       "activation_bytes": rng.randint(10**5, 10**7), "output_bytes": 8 * 4096 * 4})
        if i:
            edges.append({"src": f"l{i - 1}", "dst": f"l{i}", "bytes": 8 * 4096 * 4})
    return Profile.model_validate({"model": {"path": "synthetic-chain", "sha256": "0" * 64},
                                   "device": {"type": "synthetic", "name": "synthetic"},
                                   "batch_size": 8, "layers": layers, "edges": edges})


def example_profile(name: str) -> Profile | None:
    """The example's profile, profiled once with `python -m planner profile` and cached."""
    path = PROFILE_CACHE / f"{name}.json"
    if not path.is_file():
        PROFILE_CACHE.mkdir(parents=True, exist_ok=True)
        r = subprocess.run([sys.executable, "-m", "planner", "profile", str(ROOT / "examples" / f"{name}.py"),
                            "-q", "-o", str(path)], cwd=ROOT, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"skipping example {name}: profiling failed: {r.stderr.strip()[-200:]}", file=sys.stderr)
            return None
    return load_model(path, Profile)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def profiles(only: set[str] | None) -> dict[str, Profile]:
    """The requested profiles; a warning on stderr for each requested one skipped or unknown."""
    known = [*EXAMPLES, *IMPORTED, "chain1000"]
    for name in sorted((only or set()) - set(known)):
        warn(f"unknown profile {name!r} skipped (known: {', '.join(known)})")
    out: dict[str, Profile] = {}
    for name in EXAMPLES:
        if (only is None or name in only) and (p := example_profile(name)) is not None:
            out[name] = p
    for name, batch in IMPORTED.items():
        if only is not None and name not in only:
            continue
        path = PIPEDREAM / f"{name}.txt"
        if path.is_file():
            out[name] = import_pipedream_file(path, batch)
        else:
            warn(f"skipping {name}: no PipeDream profile {path} "
                 f"(looked for in {PIPEDREAM}; set PIPEPLAN_PIPEDREAM_PROFILES to another folder)")
    if only is None or "chain1000" in only:
        out["chain1000"] = synthetic_chain()
    return out


def markdown_pivot(rows: list[dict]) -> str:
    """One line per (profile, cluster): each method's predicted iteration ms (ratio to the lower
    bound) and wall seconds; `no fit` where it found no plan that fits."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    keys = list(dict.fromkeys((r["profile"], r["cluster"]) for r in rows))
    cell = {(r["profile"], r["cluster"], r["method"]): r for r in rows}
    lines = ["| profile | cluster | " + " | ".join(methods) + " |",
             "|---|---|" + "---|" * len(methods)]
    for p, c in keys:
        cells = []
        for m in methods:
            r = cell.get((p, c, m))
            if r is None:
                cells.append("")
            elif "iteration_ms" in r:
                cells.append(f"{r['iteration_ms']:.1f} (×{r['ratio_to_lower_bound']:.2f}) "
                             f"{r['peak_memory_gb']:.1f}/{r['memory_limit_gb']:.0f} GB, {r['wall_s']:.2f} s")
            else:
                cells.append(f"no fit, {r['wall_s']:.2f} s")
        lines.append(f"| {p} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0, help="cpsat seconds per problem")
    ap.add_argument("--only", help="comma-separated profile names")
    ap.add_argument("--clusters", help="comma-separated cluster names (1x8,4x8,16x8,4x8-tight)")
    ap.add_argument("--methods", help="comma-separated methods (default: every registered one)")
    ap.add_argument("--quick", action="store_true", help="1x8 and 4x8-tight only, cpsat 3 s")
    ap.add_argument("--global-batch", type=int,
                    help="fixed global batch for every cluster (default: 32 per device)")
    ap.add_argument("-o", "--output", default=str(RESULTS / "plan_methods.json"))
    args = ap.parse_args()
    only = set(args.only.split(",")) if args.only else None
    clusters = args.clusters.split(",") if args.clusters else list(CLUSTERS)
    if args.quick:
        clusters, args.time_limit = ["1x8", "4x8-tight"], 3.0
    methods = args.methods.split(",") if args.methods else [m for m in METHODS if m != "manual"]
    todo = profiles(only)
    if not todo:
        print("error: no profile left to run", file=sys.stderr)
        return 2
    rows = []
    header = (f"{'profile':<11} {'cluster':<10} {'method':<10} {'wall s':>7} {'iter ms':>10} "
              f"{'samples/s':>10} {'/ LB':>6} {'peak GB / limit':>16} {'stages':>6}  status")
    print(header)
    print("-" * len(header))
    for pname, profile in todo.items():
        for cname in clusters:
            c = CLUSTERS[cname]
            gb = args.global_batch or 32 * c.num_devices  # default: 4 microbatches of 8 per device
            opts = PlanOptions(global_batch=gb, microbatch_size=8, time_limit_s=args.time_limit)
            for res in compare(profile, c, opts, methods):
                row = {"profile": pname, "cluster": cname, "method": res.method,
                       "wall_s": round(res.wall_s, 3), "global_batch": gb, "microbatch_size": 8}
                if res.plan is None:
                    err = res.error or ""
                    row["error"] = err
                    status = ("does not fit" if "memory" in err else "n/a" if "not available" in err
                              else "error")
                    need = err.split("would need ")[1].split(" per device")[0] if "would need" in err else ""
                    print(f"{pname:<11} {cname:<10} {res.method:<10} {res.wall_s:>7.2f} {'-':>10} {'-':>10} "
                          f"{'-':>6} {('need ' + need) if need else '-':>16} {'-':>6}  {status}")
                else:
                    pl = res.plan
                    pr = pl.predicted
                    peak = max(s.predicted.memory_bytes for s in pl.stages)
                    limit = min(s.predicted.memory_limit_bytes for s in pl.stages)
                    row |= {"iteration_ms": pr.iteration_ms, "throughput": pr.throughput_samples_per_s,
                            "ratio_to_lower_bound": pr.ratio_to_lower_bound,
                            "lower_bound_ms": pr.lower_bound_ms, "bubble_fraction": pr.bubble_fraction,
                            "peak_memory_gb": peak / GB, "memory_limit_gb": limit / GB,
                            "stages": len(pl.stages), "replicas": [s.replicas for s in pl.stages],
                            "status": pl.solver.status}
                    print(f"{pname:<11} {cname:<10} {res.method:<10} {res.wall_s:>7.2f} {pr.iteration_ms:>10.1f} "
                          f"{pr.throughput_samples_per_s:>10.1f} {pr.ratio_to_lower_bound:>6.3f} "
                          f"{f'{peak / GB:.2f} / {limit / GB:.0f}':>16} {len(pl.stages):>6}  {pl.solver.status}")
                rows.append(row)
                sys.stdout.flush()
    print()
    print(markdown_pivot(rows))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                               "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
