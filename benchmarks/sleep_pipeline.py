"""Does a model whose layers wait (sleep F ms forward, 2F ms backward inside a custom autograd
Function, examples/sleep.py) run at the ideal pipeline time? Profile it, plan it by hand on 4
stages (one block each; the first stage also holds the input projection), run 1F1B with the
runtime and compare the measured iteration with the ideal (m + S - 1) * (F + 2F). Below the
ideal would mean the waits were skipped (a trace that re-runs only the forward's ops); far
above, runtime overhead.

    python benchmarks/sleep_pipeline.py [--f-ms 10] [--microbatches 8] [--steps 6]

Writes benchmarks/results/sleep_pipeline.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def run_one(f_ms: float, m: int, steps: int, tmp: Path) -> dict:
    env = {**os.environ, "PIPEPLAN_SLEEP_MS": str(f_ms), "PYTHONPATH": str(ROOT)}
    model = str(ROOT / "examples" / "sleep.py")
    _run("-m", "planner", "profile", model, "--batch-size", "2", "--repeats", "3", "-q",
         "-o", str(tmp / "profile.json"), env=env)
    _run("-m", "planner", "plan", str(tmp / "profile.json"), "--cluster",
         str(ROOT / "examples" / "cpu_cluster.json"), "--method", "manual", "--split", "2,1,1,1",
         "--replicas", "1,1,1,1", "--global-batch", str(2 * m), "--microbatch-size", "2",
         "-o", str(tmp / "plan.json"), env=env)
    _run("-m", "runtime", str(tmp / "plan.json"), "--model", model, "--steps", str(steps),
         "--report", str(tmp / "report.json"), env=env)
    report = json.loads((tmp / "report.json").read_text())
    plan = json.loads((tmp / "plan.json").read_text())
    profile = json.loads((tmp / "profile.json").read_text())
    stages = 4
    ideal = (m + stages - 1) * 3 * f_ms
    measured = report["iteration_ms"]
    # the same formula with what each stage's forward + backward really took (a sleep of F ms
    # overshoots by a few % on a busy machine): the schedule's own efficiency
    stage_ms = max(r["fwd_ms_per_microbatch"] + r["bwd_ms_per_microbatch"] for r in report["ranks"])
    ideal_measured = (m + stages - 1) * stage_ms
    return {
        "f_ms": f_ms, "microbatches": m, "stages": stages, "steps": steps,
        "ideal_ms": ideal, "measured_ms": measured, "ratio": measured / ideal,
        "stage_fwd_bwd_ms": stage_ms, "ideal_from_measured_stages_ms": ideal_measured,
        "ratio_to_measured_stages": measured / ideal_measured,
        "predicted_ms": plan["predicted"]["iteration_ms"],
        "profile_layer_sum_ratio": profile["measured"]["layer_sum_ratio"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--f-ms", type=float, nargs="+", default=[10.0, 20.0])
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "sleep_pipeline.json"))
    args = ap.parse_args()
    rows = []
    for f in args.f_ms:
        with tempfile.TemporaryDirectory() as d:
            rows.append(run_one(f, args.microbatches, args.steps, Path(d)))
    header = ("F ms", "m", "S", "ideal ms", "measured ms", "measured/ideal", "stage F+B measured ms",
              "measured / (m+S-1)(F+B measured)", "planner predicted ms", "profile sum/whole")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['f_ms']:g} | {r['microbatches']} | {r['stages']} | {r['ideal_ms']:.1f} | "
                     f"{r['measured_ms']:.1f} | {r['ratio']:.3f} | {r['stage_fwd_bwd_ms']:.2f} | "
                     f"{r['ratio_to_measured_stages']:.3f} | {r['predicted_ms']:.1f} | "
                     f"{r['profile_layer_sum_ratio']:.3f} |")
    print("\n".join(lines))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"command": " ".join(["python", *sys.argv]), "rows": rows},
                                            indent=2) + "\n")


if __name__ == "__main__":
    main()
