"""Does calibrating the device speed on the model itself bring the README main job's
prediction closer to its measurement? (issue 15)

The README's main job calibrates first, with calibrate's reference workload (an MLP), then
profiles the GPT example, plans and runs. The alternative profiles first and calibrates with
`--profile out/profile.json --model examples/gpt.py`: each rank's speed is then the GPT
example's own forward and backward, timed with every rank running it at once (on 2 shared cores
the two ranks contend for memory bandwidth as well as for the floating-point units, and an MLP
need not contend as the model does). A third figure re-plans the second variant's run with the
speed taken against the profile's own whole-model time instead of calibrate's solo run (so a
machine that slowed down between profiling and calibrating counts). The two run alternately, `--rounds` times each, every step
the real command (subprocesses), in one temporary directory per run.

    PYTHONPATH=. .venv/bin/python benchmarks/readme_calibration.py [--rounds 4] [--steps 10]

Prints a row per run and the median |error| per variant; writes
benchmarks/results/readme_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "readme_calibration.json"


def sh(*args: object) -> None:
    subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, check=True, capture_output=True, text=True)


def one(variant: str, steps: int, d: Path) -> dict:
    cluster, profile, plan, report = d / "cluster.json", d / "profile.json", d / "plan.json", d / "report.json"
    profile_cmd = ("-m", "planner", "profile", "examples/gpt.py", "--batch-size", 4, "--threads", 1, "-q",
                   "-o", profile)
    if variant == "reference":  # the README as it is: calibrate first
        sh("-m", "runtime", "calibrate", "--memory-gb", 0.008, "-o", cluster)
        sh(*profile_cmd)
    else:
        sh(*profile_cmd)
        sh("-m", "runtime", "calibrate", "--memory-gb", 0.008, "-o", cluster,
           "--profile", profile, "--model", "examples/gpt.py")
    sh("-m", "planner", "plan", profile, "--cluster", cluster, "--global-batch", 32,
       "--microbatch-size", 4, "-o", plan)
    sh("-m", "runtime", plan, "--model", "examples/gpt.py", "--steps", steps, "--report", report)
    p = json.loads(plan.read_text())
    r = json.loads(report.read_text())
    c = json.loads(cluster.read_text())
    drift = {}
    cal = c.get("calibration", {})
    if variant == "model" and cal.get("profile_measured_ms"):
        # the same run, predicted with the speed against the profile's own whole-model time
        # (so a machine that has slowed since profiling counts): re-planned on that cluster
        speed = cal["profile_measured_ms"] / statistics.median(cal["together_ms"])
        c2 = d / "cluster_profile_ref.json"
        c2.write_text(json.dumps({**c, "speed": round(speed, 4)}))
        plan2 = d / "plan_profile_ref.json"
        sh("-m", "planner", "plan", profile, "--cluster", c2, "--global-batch", 32,
           "--microbatch-size", 4, "-o", plan2)
        q = json.loads(plan2.read_text())
        same = [s["layers"] for s in q["stages"]] == [s["layers"] for s in p["stages"]]
        drift = {"speed_vs_profile": speed, "predicted_vs_profile_ms": q["predicted"]["iteration_ms"],
                 "same_plan_vs_profile": same,
                 "error_vs_profile_pct": 100 * (q["predicted"]["iteration_ms"] - r["iteration_ms"]) / r["iteration_ms"]}
    return {**drift, "variant": variant, "predicted_ms": p["predicted"]["iteration_ms"], "measured_ms": r["iteration_ms"],
            "error_pct": 100 * (p["predicted"]["iteration_ms"] - r["iteration_ms"]) / r["iteration_ms"],
            "speed": c.get("speed"), "stages": [len(s["layers"]) for s in p["stages"]],
            "step_ms": r.get("step_ms"), "loadavg": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("-o", "--output", default=str(RESULTS))
    args = ap.parse_args()
    rows = []
    print(f"{'variant':10s} {'speed':>6s} {'stages':>8s} {'predicted':>10s} {'measured':>9s} {'error':>7s}")
    for _ in range(args.rounds):
        for variant in ("reference", "model"):
            with tempfile.TemporaryDirectory() as tmp:
                r = one(variant, args.steps, Path(tmp))
            rows.append(r)
            print(f"{variant:10s} {r['speed']:6.3f} {str(r['stages']):>8s} {r['predicted_ms']:10.1f} "
                  f"{r['measured_ms']:9.1f} {r['error_pct']:+6.1f}%", flush=True)
            if "speed_vs_profile" in r:
                print(f"{'  vs prof':10s} {r['speed_vs_profile']:6.3f} {'same' if r['same_plan_vs_profile'] else 'OTHER':>8s} "
                      f"{r['predicted_vs_profile_ms']:10.1f} {r['measured_ms']:9.1f} {r['error_vs_profile_pct']:+6.1f}%",
                      flush=True)
    summary = {v: {"median_abs_error_pct": statistics.median(abs(r["error_pct"]) for r in rows if r["variant"] == v),
                   "within_15_pct": sum(abs(r["error_pct"]) <= 15 for r in rows if r["variant"] == v),
                   "runs": sum(r["variant"] == v for r in rows)} for v in ("reference", "model")}
    vs = [r for r in rows if "error_vs_profile_pct" in r]
    if vs:
        summary["model, speed vs the profile"] = {
            "median_abs_error_pct": statistics.median(abs(r["error_vs_profile_pct"]) for r in vs),
            "within_15_pct": sum(abs(r["error_vs_profile_pct"]) <= 15 for r in vs), "runs": len(vs)}
    for v, s in summary.items():
        print(f"{v}: median |error| {s['median_abs_error_pct']:.1f}%, within 15 % in {s['within_15_pct']} of {s['runs']}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1) + "\n")


if __name__ == "__main__":
    main()
