"""Where does tensor parallelism pay, under the cost model? GPT (examples/gpt.py) profiled at
several widths with `--tp 2,4,8` (each layer measured as it runs on one of t devices, on this
machine's CPU), then, on 2 x 8 and 16 x 8 devices at 300 GB/s inside a node and 25 GB/s
between nodes, every uniform layout (S stages of consecutive layers, r replicas, TP degree t,
replicas on consecutive ranks so a TP group stays in a node) scored by
`planner.build.evaluate`: the best PP+DP layout (t = 1) against the best with t <= 8.
(The solver does not search TP degrees yet: this brute force over uniform layouts stands in.)

    .venv/bin/python benchmarks/tensor_parallel.py [--widths 64,256,512] [--repeats 3]

Prints a table and writes benchmarks/results/tensor_parallel.json.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", default="64,256,512")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from planner.cost import layer_table
    from planner.formats import Cluster, PlanOptions

    clusters = {
        "2x8": Cluster(nodes=2, devices_per_node=8, device_memory_gb=80, intra_node_gb_per_s=300,
                       inter_node_gb_per_s=25, latency_us=5),
        "16x8": Cluster(nodes=16, devices_per_node=8, device_memory_gb=80, intra_node_gb_per_s=300,
                        inter_node_gb_per_s=25, latency_us=5),
    }
    b, gb = 4, 256
    options = PlanOptions(global_batch=gb, microbatch_size=b, optimizer="adam", method="manual")
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        t0 = time.time()
        table = layer_table(profile_gpt(width, b, args.repeats))
        prof_s = time.time() - t0
        for name, cl in clusters.items():
            pp = best(table, cl, options, b, gb // b, 1)
            tp = best(table, cl, options, b, gb // b, 8)
            rows.append({"width": width, "cluster": name, "profile_s": round(prof_s, 1),
                         "ppdp_ms": pp[0], "ppdp_layout": pp[1:], "tp_ms": tp[0],
                         "tp_layout": tp[1:], "tp_over_ppdp": tp[0] / pp[0]})
    print(f"{'width':>5}  {'cluster':>7}  {'PP+DP best (S,r,t)':>26}  {'with TP<=8 best (S,r,t)':>28}  ratio")
    for r in rows:
        print(f"{r['width']:>5}  {r['cluster']:>7}  {r['ppdp_ms']:>12.3f} ms {str(r['ppdp_layout']):>10}"
              f"  {r['tp_ms']:>14.3f} ms {str(r['tp_layout']):>10}  {r['tp_over_ppdp']:.3f}")
    out = ROOT / "benchmarks" / "results" / "tensor_parallel.json"
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                               "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
