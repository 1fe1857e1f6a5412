"""Where does tensor parallelism pay, under the cost model? GPT (examples/gpt.py) profiled at
several widths with `--tp 2,4,8` (each layer measured as it runs on one of t devices, on this
machine's CPU), then, on 2 x 8 and 16 x 8 devices at 300 GB/s inside a node and 25 GB/s
between nodes, every uniform layout (S stages of consecutive layers, r replicas, TP degree t,
replicas on consecutive ranks so a TP group stays in a node) scored by
`planner.build.evaluate`: the best PP+DP layout (t = 1) against the best with t <= 8; and
the planner itself (`plan`, method cpsat, default 10 s) with `--max-tp` 1, 2, 4 and 8: which
degrees it gives each stage, its predicted time, bound and gap. A larger space must never give
a worse plan (`--max-tp 8` <= `--max-tp 1`), and the planner must be no worse than the best
uniform layout. Each cluster also runs with "small" devices, 10 % short of what the largest
layer's parameters, gradients and Adam state unsharded: `--max-tp 1` must then say "does not
fit" and TP plans must fit.

    .venv/bin/python benchmarks/tensor_parallel.py [--widths 64,256,512] [--repeats 3]
        [--profiles benchmarks/results/tp_profiles]  # reuse (or write) gpt_w<width>.json there

Prints a table and writes benchmarks/results/tensor_parallel.json (or -o PATH).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT)  # not benchmarks/, whose runtime.py would hide the runtime package


def profile_gpt(width: int, batch: int, repeats: int) -> object:
    from profiler.profile import add_tp_degrees, profile_model_file

    os.environ.update({"PIPEPLAN_GPT_DIM": str(width), "PIPEPLAN_GPT_HEADS": "8",
                       "PIPEPLAN_GPT_BLOCKS": "4", "PIPEPLAN_GPT_VOCAB": "2048",
                       "PIPEPLAN_GPT_SEQ": "64", "PIPEPLAN_GPT_TIED": "0"})
    model = ROOT / "examples" / "gpt.py"
    # one thread, CPU time of this thread: robust on a shared, busy machine
    prof = profile_model_file(model, batch, warmup=1, repeats=repeats, threads=1, clock="thread")
    return add_tp_degrees(prof, model, [2, 4, 8], batch, warmup=1, repeats=repeats, clock="thread")


def layouts(num_layers: int, num_devices: int, per_node: int, max_tp: int):
    from planner.partition import StageChoice

    for S in (s for s in range(1, num_layers + 1) if num_layers % s == 0):
        size = num_layers // S
        for t in (1, 2, 4, 8):
            if t > max_tp or per_node % t:
                continue
            r = 1
            while S * r * t <= num_devices:
                stages, rank = [], 0
                for s in range(S):
                    devs = tuple(range(rank, rank + r * t))
                    rank += r * t
                    stages.append(StageChoice(s * size, (s + 1) * size, devs, tp=t))
                yield S, r, t, tuple(stages)
                r *= 2


def best(table, cluster, options, b, m, max_tp):
    from planner.build import evaluate
    from planner.errors import PipeplanError
    from planner.partition import Candidate

    top = None
    for S, r, t, stages in layouts(table.num_layers, cluster.num_devices,
                                   cluster.devices_per_node, max_tp):
        try:
            ev = evaluate(table, cluster, Candidate(stages, b, m), options)
        except PipeplanError:
            continue
        if ev.fits and (top is None or ev.iteration_ms < top[0]):
            top = (ev.iteration_ms, S, r, t)
    return top


def solver_row(profile, cluster, b: int, gb: int, max_tp: int, time_limit: float) -> dict:
    from planner.errors import PipeplanError
    from planner.formats import PlanOptions
    from planner.solve import make_plan

    options = PlanOptions(global_batch=gb, microbatch_size=b, optimizer="adam",
                          time_limit_s=time_limit, max_tp=max_tp)
    t0 = time.perf_counter()
    try:
        plan = make_plan(profile, cluster, options)
    except PipeplanError as exc:
        return {"max_tp": max_tp, "error": str(exc).split(";")[0], "wall_s": time.perf_counter() - t0}
    return {"max_tp": max_tp, "ms": plan.predicted.iteration_ms, "bound_ms": plan.solver.bound,
            "gap": plan.solver.gap, "wall_s": time.perf_counter() - t0,
            "stages": [[len(s.layers), s.replicas, s.tp, int(s.recompute)] for s in plan.stages]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="64,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--memory", default="80GB,small", help="80GB and/or small (see clusters_for)")
    ap.add_argument("--profiles", help="directory of gpt_w<width>.json: read if there, else written")
    ap.add_argument("-o", "--output", type=Path,
                    default=ROOT / "benchmarks" / "results" / "tensor_parallel.json")
    args = ap.parse_args()
    from planner.cost import layer_table
    from planner.formats import Cluster, PlanOptions, Profile

    def clusters_for(table, b: int) -> dict:
        """80 GB devices, and devices 10 % short of the largest layer's parameters, gradients
        and Adam state unsharded: only sharded stages fit those (recomputation cannot help)."""
        need = max(4 * table.param_bytes(i, i + 1) for i in range(table.num_layers))
        out = {}
        for mem, gbytes in (("80GB", 80.0), ("small", 0.9 * need / 1e9)):
            if mem not in args.memory.split(","):
                continue
            for nodes in (2, 16):
                out[f"{nodes}x8/{mem}"] = Cluster(nodes=nodes, devices_per_node=8, device_memory_gb=gbytes,
                                                  intra_node_gb_per_s=300, inter_node_gb_per_s=25,
                                                  latency_us=5)
        return out

    b, gb = 4, 256
    options = PlanOptions(global_batch=gb, microbatch_size=b, optimizer="adam", method="manual")
    rows = []
    print(f"{'width':>5} {'cluster':>11} {'uniform PP+DP':>14} {'uniform TP<=8':>14} "
          + " ".join(f"{'max-tp ' + str(t):>10}" for t in (1, 2, 4, 8)) + "  gap(8)  stages(8): layers,r,t,rc")
    for width in (int(w) for w in args.widths.split(",")):
        t0 = time.time()
        cached = Path(args.profiles) / f"gpt_w{width}.json" if args.profiles else None
        if cached is not None and cached.exists():
            profile = Profile.model_validate_json(cached.read_text())
        else:
            profile = profile_gpt(width, b, args.repeats)
            if cached is not None:
                cached.parent.mkdir(parents=True, exist_ok=True)
                cached.write_text(profile.model_dump_json())
        table = layer_table(profile)
        prof_s = time.time() - t0
        for name, cl in clusters_for(table, b).items():
            pp = best(table, cl, options, b, gb // b, 1)
            tp = best(table, cl, options, b, gb // b, 8)
            solved = [solver_row(profile, cl, b, gb, t, args.time_limit) for t in (1, 2, 4, 8)]
            row = {"width": width, "cluster": name, "profile_s": round(prof_s, 1),
                   "device_memory_gb": cl.node_specs()[0].device_memory_gb,
                   "ppdp_ms": pp[0] if pp else None, "ppdp_layout": pp[1:] if pp else None,
                   "tp_ms": tp[0] if tp else None, "tp_layout": tp[1:] if tp else None,
                   "solver": solved}
            # a larger --max-tp never loses a plan and never predicts slower
            row["larger_space_never_worse"] = all(
                "ms" not in a or ("ms" in c and c["ms"] <= a["ms"] * (1 + 1e-9))
                for a, c in zip(solved, solved[1:], strict=False))
            row["solver_vs_uniform"] = (solved[-1]["ms"] / tp[0]) if tp and "ms" in solved[-1] else None
            rows.append(row)

            def cell(x: dict) -> str:
                return f"{x['ms']:10.2f}" if "ms" in x else f"{'no fit':>10}"
            last = solved[-1]
            print(f"{width:>5} {name:>11} {pp[0] if pp else float('nan'):14.2f} "
                  f"{tp[0] if tp else float('nan'):14.2f} " + " ".join(cell(x) for x in solved)
                  + (f"  {100 * last['gap']:5.1f}%  {last['stages']}" if "ms" in last else ""), flush=True)
    out: Path = args.output
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
