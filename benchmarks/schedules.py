"""ZB-H1 against 1F1B on a model whose blocks wait F ms forward, B ms for the input's gradient
and W ms for the weight's (examples/sleep_zb.py, F = B = W), 4 stages of one block each (the
first also holds the input projection), 8 microbatches. Profiles the model, plans both
schedules by hand on the same split, runs each with the runtime (alternating, `--repeats`
times), and compares the measured iteration (median over steps) with the ideal
m (F + B + W) + (p - 1)(F + B + W) for 1F1B and m (F + B + W) + (p - 1)(F + B - W) for ZB-H1,
and with the planner's prediction.

    python benchmarks/schedules.py [--f-ms 10] [--microbatches 8] [--steps 6] [--repeats 2]

Writes benchmarks/results/schedules.json.
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

ROOT = Path(__file__).resolve().parents[1]
STAGES = 4


def _run(*args: str, env: dict[str, str]) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--f-ms", type=float, default=10.0)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "schedules.json"))
    args = ap.parse_args()
    f, m, p = args.f_ms, args.microbatches, STAGES
    env = {**os.environ, "PIPEPLAN_SLEEP_F_MS": str(f), "PYTHONPATH": str(ROOT)}
    model = str(ROOT / "examples" / "sleep_zb.py")
    ideal = {"1f1b": m * 3 * f + (p - 1) * 3 * f, "zb-h1": m * 3 * f + (p - 1) * (f + f - f)}
    measured: dict[str, list[float]] = {s: [] for s in ideal}
    predicted: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _run("-m", "planner", "profile", model, "--batch-size", "2", "--repeats", "3", "-q",
             "-o", str(tmp / "profile.json"), env=env)
        for schedule in ideal:
            _run("-m", "planner", "plan", str(tmp / "profile.json"), "--cluster",
                 str(ROOT / "examples" / "cpu_cluster.json"), "--method", "manual", "--split",
                 "2,1,1,1", "--global-batch", str(2 * m), "--microbatch-size", "2",
                 "--schedule", schedule, "-o", str(tmp / f"{schedule}.json"), env=env)
            predicted[schedule] = json.loads((tmp / f"{schedule}.json").read_text())["predicted"]["iteration_ms"]
        for _ in range(args.repeats):
            for schedule in ideal:
                _run("-m", "runtime", str(tmp / f"{schedule}.json"), "--model", model, "--steps",
                     str(args.steps), "--report", str(tmp / "report.json"), env=env)
                measured[schedule].append(json.loads((tmp / "report.json").read_text())["iteration_ms"])
    rows = []
    for s in ideal:
        med = statistics.median(measured[s])
        rows.append({"schedule": s, "ideal_ms": ideal[s], "measured_ms": measured[s],
                     "median_ms": med, "ratio_to_ideal": med / ideal[s],
                     "predicted_ms": predicted[s], "prediction_error": predicted[s] / med - 1})
    one, zb = rows[0]["median_ms"], rows[1]["median_ms"]
    gain = {"theoretical_ms": ideal["1f1b"] - ideal["zb-h1"], "measured_ms": one - zb,
            "share_of_theoretical": (one - zb) / (ideal["1f1b"] - ideal["zb-h1"])}
    header = ("schedule", "ideal ms", "measured ms (median)", "runs", "measured/ideal",
              "predicted ms", "predicted/measured - 1")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['ideal_ms']:.1f} | {r['median_ms']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['measured_ms'])} | {r['ratio_to_ideal']:.3f} | "
                     f"{r['predicted_ms']:.1f} | {r['prediction_error']:+.3f} |")
    print("\n".join(lines))
    print(f"ZB-H1 gain over 1F1B: {gain['measured_ms']:.1f} ms measured of {gain['theoretical_ms']:.1f} ms "
          f"in theory ({100 * gain['share_of_theoretical']:.0f} %)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(
        {"command": " ".join(["python", *sys.argv]), "f_ms": f, "microbatches": m, "stages": p,
         "rows": rows, "gain": gain}, indent=2) + "\n")


if __name__ == "__main__":
    main()
