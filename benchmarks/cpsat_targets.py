"""Does the CP-SAT planner meet its speed targets (issue 4), and how do its plans compare with
every baseline's?

Instances: examples/gpt.py at 48 blocks on 4 nodes x 8 (profiled here on CPU, or the profile
given with --gpt-profile), the imported PipeDream profiles resnet50 (4 x 4, two bandwidth
levels) and gnmt_large (16 x 1), and a synthetic 1000-layer chain on 128 nodes x 8. For each:
every method's wall seconds and simulated iteration ms; for cpsat also its status, proven
bound and gap. Prints a table and writes benchmarks/results/cpsat_targets.json.

    .venv/bin/python benchmarks/cpsat_targets.py [--only gpt48,resnet50,...] [--time-limit 10]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# keep benchmarks/ off sys.path so no script name here can shadow a package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from planner.build import evaluate  # noqa: E402
from planner.cost import layer_table  # noqa: E402
from planner.formats import Cluster, PlanOptions, Profile  # noqa: E402
from planner.importers.pipedream import import_pipedream_file  # noqa: E402
from planner.io import load_model  # noqa: E402
from planner.search import solve_detailed  # noqa: E402
from planner.solve import METHODS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROFILES = Path(os.environ.get("PIPEPLAN_PIPEDREAM_PROFILES",
                               ROOT.parent / "shared" / "data" / "pipedream-profiles"))
BASELINES = ["pipedream", "blocks", "params", "uniform"]


def gpt_profile(path: str | None) -> Profile:
    if path:
        return load_model(path, Profile)
    out = Path(tempfile.gettempdir()) / "pipeplan-gpt48.json"
    if not out.exists():
        env = dict(os.environ, PIPEPLAN_GPT_BLOCKS="48")
        subprocess.run([sys.executable, "-m", "planner", "profile", str(ROOT / "examples/gpt.py"),
                        "--batch-size", "8", "--repeats", "3", "--threads", "1", "-q",
                        "-o", str(out)], check=True, env=env)
    return load_model(out, Profile)


def chain_profile(num_layers: int = 1000, seed: int = 0) -> Profile:
    """A synthetic chain with uneven layers (times 0.05-0.35 ms, 2-20 MB of parameters)."""
    rng = random.Random(seed)
    layers = [dict(name=f"layer{i}", fwd_ms=rng.uniform(0.05, 0.15), bwd_ms=rng.uniform(0.1, 0.2),
                   param_bytes=int(rng.uniform(2e6, 2e7)), activation_bytes=int(rng.uniform(1e7, 4e7)),
                   output_bytes=int(4e6)) for i in range(num_layers)]
    return Profile(model={"path": "synthetic-chain", "sha256": "0"},
                   device={"type": "gpu", "name": "synthetic"}, batch_size=4, layers=layers)


def pipedream_profile(name: str, batch: int) -> Profile:
    """The imported PipeDream profile `name`; a missing file ends the run with one line (exit 2)."""
    path = PROFILES / f"{name}.txt"
    if not path.is_file():
        print(f"cpsat_targets: no PipeDream profile {path}: profiles are looked for in {PROFILES} "
              "(set PIPEPLAN_PIPEDREAM_PROFILES to the folder of resnet50.txt, gnmt_large.txt)",
              file=sys.stderr)
        raise SystemExit(2)
    return import_pipedream_file(path, batch)


def instances(args: argparse.Namespace
              ) -> list[tuple[str, Profile, Cluster, PlanOptions, str, float]]:
    tl = args.time_limit
    out = []
    if "gpt48" in args.only:
        out.append(("gpt48", gpt_profile(args.gpt_profile),
                    Cluster(nodes=4, devices_per_node=8, device_memory_gb=2,
                            intra_node_gb_per_s=300, inter_node_gb_per_s=25, latency_us=5),
                    PlanOptions(global_batch=64, microbatch_size=8, time_limit_s=tl),
                    "proven optimal < 2 s", 0.0))
    if "resnet50" in args.only:
        out.append(("resnet50", pipedream_profile("resnet50", 128),
                    Cluster(nodes=4, devices_per_node=4, device_memory_gb=16,
                            intra_node_gb_per_s=100, inter_node_gb_per_s=10, latency_us=5),
                    PlanOptions(global_batch=1024, microbatch_size=64, time_limit_s=tl),
                    "gap <= 1% < 5 s", 0.01))
    if "gnmt_large" in args.only:
        out.append(("gnmt_large", pipedream_profile("gnmt_large", 64),
                    Cluster(nodes=16, devices_per_node=1, device_memory_gb=16,
                            intra_node_gb_per_s=100, inter_node_gb_per_s=10, latency_us=5),
                    PlanOptions(global_batch=512, microbatch_size=64, time_limit_s=tl),
                    "proven optimal < 5 s", 0.0))
    if "chain1000" in args.only:
        out.append(("chain1000", chain_profile(),
                    Cluster(nodes=128, devices_per_node=8, device_memory_gb=16,
                            intra_node_gb_per_s=300, inter_node_gb_per_s=25, latency_us=5),
                    PlanOptions(global_batch=512, microbatch_size=4, time_limit_s=tl),
                    "gap <= 1% within 10 s", 0.01))
    return out


def run(name: str, profile: Profile, cluster: Cluster, options: PlanOptions, target: str,
        gap_limit: float) -> dict:
    """Every baseline, then cpsat (stopping at `gap_limit` when it cannot prove optimality)."""
    table = layer_table(profile)
    rows = []
    for method in BASELINES:
        t0 = time.perf_counter()
        try:
            cand = METHODS[method](profile, cluster, options.model_copy(update={"method": method}))
            wall = time.perf_counter() - t0
            ev = evaluate(table, cluster, cand, options)
            rows.append({"method": method, "wall_s": wall, "iteration_ms": ev.iteration_ms,
                         "fits": ev.fits, "stages": len(cand.stages),
                         "devices": sum(s.replicas for s in cand.stages)})
        except Exception as exc:  # report, do not stop the benchmark
            rows.append({"method": method, "wall_s": time.perf_counter() - t0, "error": str(exc)})
    t0 = time.perf_counter()
    cand, _ = solve_detailed(profile, cluster, options)
    wall = time.perf_counter() - t0
    ev = evaluate(table, cluster, cand, options)
    info = dict(cand.solver)
    rows.append({"method": "cpsat", "wall_s": wall, "iteration_ms": ev.iteration_ms,
                 "fits": ev.fits, "stages": len(cand.stages),
                 "devices": sum(s.replicas for s in cand.stages), "status": info["status"],
                 "bound_ms": info.get("bound"), "gap": info.get("gap"),
                 "evaluations": info.get("evaluations")})
    return {"instance": name, "layers": table.num_layers, "devices": cluster.num_devices,
            "num_microbatches": cand.num_microbatches, "target": target, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="gpt48,resnet50,gnmt_large,chain1000")
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--gpt-profile", default=None)
    parser.add_argument("-o", "--output", default=str(ROOT / "benchmarks/results/cpsat_targets.json"))
    args = parser.parse_args()
    args.only = args.only.split(",")
    report = []
    for inst in instances(args):
        res = run(*inst)
        report.append(res)
        print(f"\n{res['instance']}: {res['layers']} layers, {res['devices']} devices, "
              f"m = {res['num_microbatches']}; target: {res['target']}")
        print(f"{'method':10} {'wall s':>8} {'iter ms':>10} {'stages':>6} {'devs':>5}  status / gap")
        for r in res["rows"]:
            if "error" in r:
                print(f"{r['method']:10} {r['wall_s']:8.2f}  error: {r['error'][:60]}")
                continue
            extra = ""
            if r["method"] == "cpsat":
                gap = r["gap"]
                extra = (f"{r['status']}, bound {r['bound_ms']:.2f} ms, "
                         f"gap {gap * 100:.2f}%" if gap is not None else r["status"])
            print(f"{r['method']:10} {r['wall_s']:8.2f} {r['iteration_ms']:10.2f} "
                  f"{r['stages']:6d} {r['devices']:5d}  {extra}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
