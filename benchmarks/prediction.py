"""How close is the predicted iteration time to the measured one, on a calibrated cluster and
after one `refine`?

Every step is the real command a user runs (subprocesses): `python -m planner profile`,
`python -m runtime calibrate`, `python -m planner plan`, `python -m runtime ... --report`,
`python -m planner refine --profile`, and a second run of the refined plan. Rows:

- **sleep model** (benchmarks/runtime.py's: per layer a Linear, then F ms asleep forward and 2F
  backward; one layer per stage), S = 2 and 4 stages, 8 microbatches, F = 5 ms;
- **GPT example** (examples/gpt.py at its default size), S = 2 and 4 stages (`--method manual`),
  global batch 32, microbatches of 4, profiled at batch 4 with one thread;
- **the README's main job**: calibrate first (one rank per CPU core, reference workload,
  devices of 8 MB), then profile, `plan` (cpsat chooses the stages) and run — predicted
  against measured;
- **calibrate repeatability**: two calibrations of 4 ranks, side by side.

For each pipeline row: the prediction on the calibrated cluster (calibrate with `--profile
--model`, so device speed is the model's own under full load) against the first run; refine;
the refined plan's prediction against a second run. Iteration = median of steps 2..N of rank 0.

    .venv/bin/python benchmarks/prediction.py [--steps 10]        # ~3-5 min on 2 shared cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "prediction.json"
PY = sys.executable


def sh(*args: object, env: dict[str, str] | None = None) -> str:
    r = subprocess.run([PY, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    if r.returncode:
        raise RuntimeError(f"{' '.join(map(str, args))} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def sleep_model_source() -> str:
    spec = importlib.util.spec_from_file_location("_bench_runtime", ROOT / "benchmarks" / "runtime.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return str(mod.SLEEP_MODEL)


def pipeline_row(name: str, model: Path, env: dict[str, str], S: int, split: list[int], batch: int,
                 global_batch: int, steps: int, tmp: Path) -> dict:
    d = tmp / f"{name}-S{S}"
    d.mkdir()
    load = [os.getloadavg()[0]]
    sh("-m", "planner", "profile", model, "--batch-size", batch, "--threads", "1", "-q",
       "-o", d / "profile.json", env=env)
    sh("-m", "runtime", "calibrate", "--nproc-per-node", S, "-o", d / "cluster.json",
       "--profile", d / "profile.json", "--model", model, env=env)
    sh("-m", "planner", "plan", d / "profile.json", "--cluster", d / "cluster.json",
       "--global-batch", global_batch, "--microbatch-size", batch, "--method", "manual",
       "--split", ",".join(map(str, split)), "--optimizer", "sgd", "-o", d / "plan.json", env=env)
    run = ["--steps", steps, "--optimizer", "sgd", "--lr", "0"]
    sh("-m", "runtime", d / "plan.json", "--model", model, *run, "--report", d / "report.json", env=env)
    out = sh("-m", "planner", "refine", d / "plan.json", d / "report.json", "-o", d / "plan2.json",
             "--profile", d / "profile.json", env=env)
    load.append(os.getloadavg()[0])
    sh("-m", "runtime", d / "plan2.json", "--model", model, *run, "--report", d / "report2.json", env=env)
    load.append(os.getloadavg()[0])
    p1 = json.loads((d / "plan.json").read_text())["predicted"]["iteration_ms"]
    m1 = json.loads((d / "report.json").read_text())["iteration_ms"]
    p2 = json.loads((d / "plan2.json").read_text())["predicted"]["iteration_ms"]
    m2 = json.loads((d / "report2.json").read_text())["iteration_ms"]
    cl = json.loads((d / "cluster.json").read_text())
    corr = json.loads((d / "plan2.corrections.json").read_text())
    return {"model": name, "S": S, "split": split, "loadavg": load, "predicted_calibrated_ms": p1, "measured_ms": m1,
            "error_calibrated_pct": 100 * (p1 - m1) / m1, "predicted_refined_ms": p2,
            "measured_refined_ms": m2, "error_refined_pct": 100 * (p2 - m2) / m2,
            "step_ms": json.loads((d / "report.json").read_text())["step_ms"],
            "step_ms_refined": json.loads((d / "report2.json").read_text())["step_ms"],
            "calibrated_latency_us": cl["intra_node_latency_us"], "calibrated_gb_per_s": cl["intra_node_gb_per_s"],
            "calibrated_speed": cl["speed"], "calibrated_p2p_overhead_us": cl.get("p2p_overhead_us", 0.0),
            "p2p_overhead_us": corr["p2p_overhead_us_after"],
            "fwd_scales": [s["fwd_scale"] for s in corr["stages"]],
            "bwd_scales": [s["bwd_scale"] for s in corr["stages"]], "refine_output": out}


def readme_row(steps: int, tmp: Path) -> dict:
    d = tmp / "readme"
    d.mkdir()
    sh("-m", "runtime", "calibrate", "--memory-gb", 0.008, "-o", d / "cluster.json")  # a rank per core
    sh("-m", "planner", "profile", "examples/gpt.py", "--batch-size", 4, "--threads", 1, "-q",
       "-o", d / "profile.json")
    sh("-m", "planner", "plan", d / "profile.json", "--cluster", d / "cluster.json", "--global-batch", 32,
       "--microbatch-size", 4, "-o", d / "plan.json")
    sh("-m", "runtime", d / "plan.json", "--model", "examples/gpt.py", "--steps", steps,
       "--report", d / "report.json")
    plan = json.loads((d / "plan.json").read_text())
    p = plan["predicted"]["iteration_ms"]
    m = json.loads((d / "report.json").read_text())["iteration_ms"]
    return {"stages": [(len(s["layers"]), s["replicas"]) for s in plan["stages"]],
            "predicted_ms": p, "measured_ms": m, "error_pct": 100 * (p - m) / m}


def calibrate_twice(tmp: Path) -> dict:
    rows = []
    for i in range(2):
        sh("-m", "runtime", "calibrate", "--nproc-per-node", 4, "-o", tmp / f"c{i}.json")
        rows.append(json.loads((tmp / f"c{i}.json").read_text()))
    keys = ["intra_node_latency_us", "intra_node_gb_per_s", "speed", "allreduce_efficiency", "p2p_overhead_us"]
    return {k: [r.get(k, 0.0) for r in rows]
            + [100 * abs(rows[0].get(k, 0.0) - rows[1].get(k, 0.0)) / max(rows[0].get(k, 0.0), 1e-12)]
            for k in keys}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--f-ms", type=float, default=5.0)
    ap.add_argument("--only", default="sleep,gpt,readme,calibrate",
                    help="which parts to run (comma-separated: sleep, gpt, readme, calibrate)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory(prefix="pipeplan-pred-") as tmpdir:
        tmp = Path(tmpdir)
        sleep = tmp / "sleep_model.py"
        sleep.write_text(sleep_model_source())
        parts = set(args.only.split(","))
        for S in (2, 4) if "sleep" in parts else ():
            env = {"PIPEPLAN_SLEEP_LAYERS": str(S), "PIPEPLAN_SLEEP_F_MS": str(args.f_ms)}
            rows.append(pipeline_row("sleep", sleep, env, S, [1] * S, 4, 32, args.steps, tmp))
            print(f"sleep S={S}: {rows[-1]['error_calibrated_pct']:+.1f}% -> {rows[-1]['error_refined_pct']:+.1f}%",
                  flush=True)
        for S, split in ((2, [3, 3]), (4, [2, 1, 1, 2])) if "gpt" in parts else ():
            rows.append(pipeline_row("gpt", ROOT / "examples" / "gpt.py", {}, S, split, 4, 32, args.steps, tmp))
            print(f"gpt S={S}: {rows[-1]['error_calibrated_pct']:+.1f}% -> {rows[-1]['error_refined_pct']:+.1f}%",
                  flush=True)
        readme = readme_row(args.steps, tmp) if "readme" in parts else None
        print(f"README main job: {readme}", flush=True)
        repeat = calibrate_twice(tmp) if "calibrate" in parts else {}
    load_after = os.getloadavg()
    lines = ["| model | S | calibrated: predicted / measured ms (error) | refined: predicted / measured ms (error) "
             "| calibrated latency us, GB/s, speed, p2p overhead us | fitted p2p overhead us | fwd / bwd scales | load avg |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['S']} | {r['predicted_calibrated_ms']:.1f} / {r['measured_ms']:.1f} "
            f"({r['error_calibrated_pct']:+.1f}%) | {r['predicted_refined_ms']:.1f} / {r['measured_refined_ms']:.1f} "
            f"({r['error_refined_pct']:+.1f}%) | {r['calibrated_latency_us']:.0f}, {r['calibrated_gb_per_s']:.2f}, "
            f"{r['calibrated_speed']:.2f}, {r['calibrated_p2p_overhead_us']:.0f} | {r['p2p_overhead_us']:.0f} | "
            f"{', '.join(f'{x:.2f}' for x in r['fwd_scales'])} / {', '.join(f'{x:.2f}' for x in r['bwd_scales'])} | "
            f"{' → '.join(f'{x:.1f}' for x in r['loadavg'])} |")
    table = "\n".join(lines)
    readme_line = "" if readme is None else (f"README main job (calibrated, cpsat, stages (layers, replicas) {readme['stages']}): predicted "
                   f"{readme['predicted_ms']:.1f} ms, measured {readme['measured_ms']:.1f} ms ({readme['error_pct']:+.1f}%)")
    repeat_line = "calibrate twice (first, second, difference %): " + "; ".join(
        f"{k} {v[0]:.3g} / {v[1]:.3g} ({v[2]:.1f}%)" for k, v in repeat.items())
    print(table)
    print(readme_line)
    print(repeat_line)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1-minute; {os.cpu_count()} cores)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "steps": args.steps, "f_ms": args.f_ms, "rows": rows, "readme": readme, "calibrate_twice": repeat,
        "loadavg_before": load_before, "loadavg_after": load_after, "table": table,
        "readme_line": readme_line, "repeat_line": repeat_line}, indent=2) + "\n")


if __name__ == "__main__":
    main()
