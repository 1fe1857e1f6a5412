"""How does the predicted iteration time scale with the number of devices, for the CP-SAT plan
and each baseline?

A synthetic chain (cpsat_targets.py's generator, 1000 layers, activations scaled down 10x so
that 4 devices can hold it), global batch 512 in microbatches of 4, on 4 to 1024 devices
(nodes of 8; 4 devices = one node of 4), 16 GB per device. Every method's plan
is simulated by the core; cpsat runs with its default 10 s time limit. Writes
benchmarks/results/scaling.json and benchmarks/results/scaling.png (with -o PATH: PATH and the
.png of the same stem beside it).

    .venv/bin/python benchmarks/scaling.py [--devices 4,8,...] [--time-limit 10] [-o PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# keep benchmarks/ off sys.path so no script name here can shadow a package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks.cpsat_targets import chain_profile  # noqa: E402
from planner.build import evaluate  # noqa: E402
from planner.cost import layer_table, lower_bound_ms  # noqa: E402
from planner.formats import Cluster, PlanOptions  # noqa: E402
from planner.search import solve_detailed  # noqa: E402
from planner.solve import METHODS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHOD_NAMES = ["cpsat", "pipedream", "blocks", "params", "uniform"]


def cluster_of(devices: int) -> Cluster:
    per_node = min(8, devices)
    return Cluster(nodes=devices // per_node, devices_per_node=per_node, device_memory_gb=16,
                   intra_node_gb_per_s=300, inter_node_gb_per_s=25, latency_us=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4,8,16,32,64,128,256,512,1024")
    parser.add_argument("--layers", type=int, default=1000)
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("-o", "--output", type=Path,
                        default=ROOT / "benchmarks/results/scaling.json",
                        help="the JSON; the plot goes beside it, same stem, .png")
    args = parser.parse_args()
    profile = chain_profile(args.layers)
    profile = profile.model_copy(update={"layers": [
        x.model_copy(update={"activation_bytes": x.activation_bytes // 10}) for x in profile.layers]})
    table = layer_table(profile)
    options = PlanOptions(global_batch=512, microbatch_size=4, time_limit_s=args.time_limit)
    rows = []
    print(f"{'devices':>7} " + " ".join(f"{m:>12}" for m in METHOD_NAMES) + f" {'cpsat gap':>9} {'bound':>9}")
    for n in [int(x) for x in args.devices.split(",")]:
        cluster = cluster_of(n)
        row: dict = {"devices": n, "lower_bound_ms": lower_bound_ms(
            table, options.global_batch // 4, 1.0, float(n))}
        for method in METHOD_NAMES:
            t0 = time.perf_counter()
            try:
                if method == "cpsat":
                    cand, _ = solve_detailed(profile, cluster, options)
                    row["cpsat_gap"] = cand.solver.get("gap")
                    row["cpsat_bound_ms"] = cand.solver.get("bound")
                    row["cpsat_status"] = cand.solver.get("status")
                else:
                    cand = METHODS[method](profile, cluster,
                                           options.model_copy(update={"method": method}))
                ev = evaluate(table, cluster, cand, options)
                row[method] = ev.iteration_ms if ev.fits else None
            except Exception as exc:  # a method that cannot plan this size: no point
                row[method] = None
                row[f"{method}_error"] = str(exc)[:200]
            row[f"{method}_wall_s"] = time.perf_counter() - t0
        rows.append(row)
        cells = " ".join(f"{row[m]:12.2f}" if row[m] is not None else f"{'-':>12}"
                         for m in METHOD_NAMES)
        gap = row.get("cpsat_gap")
        print(f"{n:7d} {cells} {gap * 100 if gap is not None else float('nan'):8.2f}% "
              f"{row.get('cpsat_bound_ms') or float('nan'):9.2f}", flush=True)
    out: Path = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for method in METHOD_NAMES:
        pts = [(r["devices"], r[method]) for r in rows if r.get(method)]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=method,
                    linewidth=2.5 if method == "cpsat" else 1.2)
    ax.plot([r["devices"] for r in rows], [r["lower_bound_ms"] for r in rows], "k:",
            label="compute lower bound")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices (nodes of 8, 300 / 25 GB/s)")
    ax.set_ylabel("predicted iteration ms (simulated)")
    ax.set_title(f"{args.layers}-layer chain, global batch 512, microbatch 4")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    main()
