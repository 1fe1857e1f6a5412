"""Is the optimizer step the planner prices the step the runtime takes, and what does pricing
it do to the README main job's prediction? (issues 13, 15)

Part 1, per bundled example (MLP, GPT, U-Net) and optimizer (sgd, momentum, adam): the
profile's per-layer steps added up (what the planner prices for a one-stage plan), one step
over the whole model (`profiler.optimizers.step_ms_all` on the built model), and the step a one-stage run measured (`python -m
runtime`, report `optimizer_ms`: optimizer.step + zero_grad, median of the steps after the
first).

Part 2, the README main job (calibrate, profile, plan, run; every step the real command, in
a fresh temporary directory per round): the plan's prediction with the optimizer step priced
(as `plan` writes it now) and the same plan simulated without it, against the one measured
iteration.

    PYTHONPATH=. .venv/bin/python benchmarks/optimizer_step.py [--rounds 4] [--steps 10] [-o PATH]

Prints both tables; writes benchmarks/results/optimizer_step.json (or -o PATH).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "optimizer_step.json"

import torch  # noqa: E402

from planner.formats import Plan  # noqa: E402
from planner.io import load_model  # noqa: E402
from planner.schedules import plan_actions  # noqa: E402
from planner.simulator import costs_from_plan, simulate_costs  # noqa: E402
from profiler.loader import load_model_file  # noqa: E402
from profiler.optimizers import step_ms_all  # noqa: E402

MODELS = {"mlp": 8, "gpt": 4, "unet": 4}  # profile batch size (the README's for GPT)


def sh(*args: object) -> None:
    subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, check=True, capture_output=True, text=True)


def steps_part(steps: int, d: Path) -> list[dict]:
    rows = []
    one = d / "one_device.json"
    one.write_text(json.dumps({"nodes": 1, "devices_per_node": 1, "device_memory_gb": 80,
                               "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1}))
    for model, b in MODELS.items():
        prof_path = d / f"{model}.json"
        sh("-m", "planner", "profile", f"examples/{model}.py", "--batch-size", b, "--threads", 1, "-q",
           "-o", prof_path)
        prof = json.loads(prof_path.read_text())
        L = len(prof["layers"])
        torch.set_num_threads(1)  # as the profile was taken
        whole = step_ms_all(load_model_file(ROOT / "examples" / f"{model}.py").build_model().parameters(),
                            torch.device("cpu"))
        for opt in ("sgd", "momentum", "adam"):
            plan_path, report = d / f"{model}_{opt}_plan.json", d / f"{model}_{opt}_report.json"
            sh("-m", "planner", "plan", prof_path, "--method", "manual", "--split", L, "--cluster", one,
               "--global-batch", 4 * b, "--microbatch-size", b,
               "--optimizer", opt, "-o", plan_path)
            sh("-m", "runtime", plan_path, "--model", f"examples/{model}.py", "--steps", steps,
               "--report", report)
            r = json.loads(report.read_text())["ranks"][0]
            layer_sum = sum((x.get("optimizer_ms") or {}).get(opt, 0.0) for x in prof["layers"])
            rows.append({"model": model, "optimizer": opt, "layers": L, "layer_sum_ms": layer_sum,
                         "whole_ms": whole[opt],
                         "planned_ms": json.loads(plan_path.read_text())["stages"][0]["predicted"]["optimizer_ms"],
                         "run_ms": r["optimizer_ms"], "run_over_planned": r["optimizer_ms"] / layer_sum,
                         "loadavg": os.getloadavg()[0]})
            print(f"{model:5s} {opt:9s} layers {L:3d}  sum of layers {layer_sum:7.3f} ms  whole {rows[-1]['whole_ms']:7.3f}"
                  f"  run {r['optimizer_ms']:7.3f}  run/planned {rows[-1]['run_over_planned']:.2f}", flush=True)
    return rows


def without_step(plan: Plan) -> float:
    costs = dataclasses.replace(costs_from_plan(plan), optimizer_ms=None)
    return simulate_costs(costs, plan_actions(plan)).iteration_ms


def readme_round(steps: int, d: Path) -> dict:
    cluster, profile, plan, report = d / "cluster.json", d / "profile.json", d / "plan.json", d / "report.json"
    sh("-m", "runtime", "calibrate", "--memory-gb", 0.008, "-o", cluster)
    sh("-m", "planner", "profile", "examples/gpt.py", "--batch-size", 4, "--threads", 1, "-q", "-o", profile)
    sh("-m", "planner", "plan", profile, "--cluster", cluster, "--global-batch", 32, "--microbatch-size", 4,
       "-o", plan)
    sh("-m", "runtime", plan, "--model", "examples/gpt.py", "--steps", steps, "--report", report)
    p = load_model(plan, Plan)
    r = json.loads(report.read_text())
    with_ms, without_ms, meas = p.predicted.iteration_ms, without_step(p), r["iteration_ms"]
    return {"predicted_ms": with_ms, "predicted_without_step_ms": without_ms, "measured_ms": meas,
            "error_pct": 100 * (with_ms - meas) / meas, "error_without_step_pct": 100 * (without_ms - meas) / meas,
            "planned_step_ms": [s.predicted.optimizer_ms for s in p.stages],
            "run_step_ms": [x["optimizer_ms"] for x in r["ranks"]],
            "stages": [len(s.layers) for s in p.stages], "loadavg": os.getloadavg()[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--skip-steps", action="store_true", help="only part 2")
    ap.add_argument("-o", "--output", type=Path, default=RESULTS)
    args = ap.parse_args()
    out: dict = {"steps": args.steps}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_steps:
            out["steps_part"] = steps_part(args.steps, Path(tmp))
        rounds = []
        for k in range(args.rounds):
            d = Path(tmp) / f"readme{k}"
            d.mkdir()
            rounds.append(readme_round(args.steps, d))
            x = rounds[-1]
            print(f"README round {k}: predicted {x['predicted_ms']:.1f} ms (without the step "
                  f"{x['predicted_without_step_ms']:.1f}), measured {x['measured_ms']:.1f}: error "
                  f"{x['error_pct']:+.1f} % ({x['error_without_step_pct']:+.1f} % without); steps planned "
                  f"{', '.join(f'{v:.2f}' for v in x['planned_step_ms'])} ms, run "
                  f"{', '.join(f'{v:.2f}' for v in x['run_step_ms'])} ms", flush=True)
        out["readme"] = rounds
    if out["readme"]:
        med = statistics.median(abs(x["error_pct"]) for x in out["readme"])
        med0 = statistics.median(abs(x["error_without_step_pct"]) for x in out["readme"])
        print(f"median |error| over {len(out['readme'])} rounds: {med:.1f} % with the step, {med0:.1f} % without")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
