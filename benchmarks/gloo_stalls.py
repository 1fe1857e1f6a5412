"""Do bound ranks and receives posted two actions ahead take gloo's stalls out of a CPU pipeline?

The GPT example (examples/gpt.py, profiled at batch 4 with one thread) on 2 stages of one rank
each (splits 3,3 and 4,2; global batch 32, microbatches of 4, 1F1B), run with the real runtime
(`python -m runtime ... --steps N --report`) under four settings, interleaved round by round so
they share the machine's drift:

- `PIPEPLAN_CPU_BIND` 0 or 1: each rank bound to its own core (runtime.cpu_binding);
- `PIPEPLAN_RECV_LOOKAHEAD` 1 or 2: receives posted one or two actions ahead (runtime.executor).

Per setting: the median over rounds of the run's iteration (median of steps 2..N of rank 0),
its range, the bottleneck rank's idle time per step, and the ratio to the old setting (0, 1)
measured in the same rounds. The predicted iteration (on a fixed 2-device cluster) is printed
beside it.

    .venv/bin/python benchmarks/gloo_stalls.py [--rounds 3] [--steps 30] [-o PATH]
    # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from prediction import sh  # benchmarks/ is the script's folder: its helper that runs a command

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "gloo_stalls.json"
SETTINGS = [(0, 1), (1, 1), (0, 2), (1, 2)]  # (bind, lookahead); the first is the old runtime
CLUSTER = {"nodes": 1, "devices_per_node": 2, "device_memory_gb": 1.0, "intra_node_gb_per_s": 3.0,
           "inter_node_gb_per_s": 3.0, "latency_us": 150.0}


def check_splits(splits: str, layers: int) -> list[str]:
    """The ';'-separated splits (layers per stage); one that is not whole numbers adding up to
    the model's `layers` is one line on stderr, exit 2 (before any run)."""
    out = splits.split(";")
    for split in out:
        try:
            covered = sum(int(x) for x in split.split(","))
        except ValueError:
            covered = None
        if covered != layers:
            print(f"gloo_stalls: --splits {split!r} must be layer counts per stage adding up to "
                  f"examples/gpt.py's {layers} layers (e.g. 3,3;4,2)", file=sys.stderr)
            raise SystemExit(2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--splits", default="3,3;4,2")
    ap.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        (tmp / "cluster.json").write_text(json.dumps(CLUSTER))
        sh("-m", "planner", "profile", "examples/gpt.py", "--batch-size", 4, "--threads", 1, "-q",
           "-o", tmp / "profile.json")
        layers = len(json.loads((tmp / "profile.json").read_text())["layers"])
        for split in check_splits(args.splits, layers):
            plan = tmp / f"plan-{split.replace(',', '-')}.json"
            sh("-m", "planner", "plan", tmp / "profile.json", "--cluster", tmp / "cluster.json",
               "--global-batch", 32, "--microbatch-size", 4, "--method", "manual", "--split", split,
               "-o", plan)
            runs: dict[tuple[int, int], list[dict]] = {s: [] for s in SETTINGS}
            for _ in range(args.rounds):
                for bind, ahead in SETTINGS:
                    rep = tmp / "report.json"
                    sh("-m", "runtime", plan, "--model", "examples/gpt.py", "--steps", args.steps,
                       "--report", rep, env={"PIPEPLAN_CPU_BIND": str(bind),
                                             "PIPEPLAN_RECV_LOOKAHEAD": str(ahead)})
                    r = json.loads(rep.read_text())
                    runs[(bind, ahead)].append(r)
            base = [r["iteration_ms"] for r in runs[SETTINGS[0]]]
            for s in SETTINGS:
                its = [r["iteration_ms"] for r in runs[s]]
                # the bottleneck: the rank that idles least
                idle = [min(x["idle_ms"] for x in r["ranks"]) for r in runs[s]]
                rows.append({
                    "split": split, "bind": s[0], "lookahead": s[1],
                    "predicted_ms": runs[s][0]["predicted_iteration_ms"],
                    "iteration_ms": its, "median_ms": statistics.median(its),
                    "bottleneck_idle_ms": idle,
                    "ratio_to_old": statistics.median(a / b for a, b in zip(its, base, strict=True)),
                })
    print(f"{'split':6s} {'bind':>4s} {'ahead':>5s} {'predicted':>9s} {'median ms':>9s} "
          f"{'range ms':>13s} {'idle ms':>8s} {'x old':>6s}")
    for r in rows:
        print(f"{r['split']:6s} {r['bind']:4d} {r['lookahead']:5d} {r['predicted_ms']:9.1f} "
              f"{r['median_ms']:9.1f} {min(r['iteration_ms']):6.1f}-{max(r['iteration_ms']):<6.1f} "
              f"{statistics.median(r['bottleneck_idle_ms']):8.1f} {r['ratio_to_old']:6.3f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"rounds": args.rounds, "steps": args.steps, "rows": rows,
                                       "load": os.getloadavg()}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
