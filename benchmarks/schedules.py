"""ZB-H1 against 1F1B on a model whose blocks wait F ms forward, B ms for the input's gradient
and W ms for the weight's (examples/sleep_zb.py, F = B = W), 4 stages of one block each (the
first also holds the input projection), 8 microbatches. Profiles the model, plans both
schedules by hand on the same split, runs each with the runtime (alternating, `--repeats`
times), and compares the measured iteration (median over steps) with the ideal
m (F + B + W) + (p - 1)(F + B + W) for 1F1B and m (F + B + W) + (p - 1)(F + B - W) for ZB-H1,
and with the planner's prediction. The same model and split also run under
torch.distributed.pipelining's Schedule1F1B and ScheduleInterleavedZeroBubble (one stage per
rank), timed the same way (median step after the first).

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


def torch_worker(name: str, m: int, b: int, steps: int, out: str) -> None:
    """One rank of examples/sleep_zb.py under a torch.distributed.pipelining schedule."""
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleInterleavedZeroBubble,
    )

    from profiler.loader import load_model_file

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    mf = load_model_file(str(ROOT / "examples" / "sleep_zb.py"))
    torch.manual_seed(0)
    model = mf.build_model()
    parts = [nn.Sequential(model.inp, model.blocks[0])] + [model.blocks[i] for i in range(1, STAGES)]
    (x,), _ = mf.make_batch(b)
    if rank > 0:
        x = x.requires_grad_(True)
    stage = PipelineStage(parts[rank], rank, STAGES, torch.device("cpu"), input_args=(x,))
    if name == "1f1b":
        schedule = Schedule1F1B(stage, m, loss_fn=mf.loss_fn)
    else:
        schedule = ScheduleInterleavedZeroBubble([stage], m, loss_fn=mf.loss_fn)
    times = []
    for s in range(steps):
        torch.manual_seed(s)
        (inputs,), target = mf.make_batch(m * b)
        t0 = time.time()
        if rank == 0:
            schedule.step(inputs)
        elif rank == STAGES - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        times.append((time.time() - t0) * 1e3)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(name: str, env: dict[str, str], m: int, b: int, steps: int, tmp: Path) -> float:
    import socket

    with socket.socket() as sock:  # (benchmarks/runtime.py shadows the runtime package here)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp / f"torch_{name}.json"
    procs = []
    for r in range(STAGES):
        e = dict(env, RANK=str(r), WORLD_SIZE=str(STAGES), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--torch-worker", name, str(m), str(b), str(steps), str(out)],
            env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        if proc.returncode:
            raise SystemExit(f"torch pipelining rank failed:\n{err.decode()[-3000:]}")
    times = json.loads(out.read_text())
    return float(statistics.median(times[1:] if len(times) > 1 else times))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        torch_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--f-ms", type=float, default=10.0)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "schedules.json"))
    args = ap.parse_args()
    f, m, p = args.f_ms, args.microbatches, STAGES
    env = {**os.environ, "PIPEPLAN_SLEEP_F_MS": str(f), "PYTHONPATH": str(ROOT)}
    model = str(ROOT / "examples" / "sleep_zb.py")
    ideal = {"1f1b": m * 3 * f + (p - 1) * 3 * f, "zb-h1": m * 3 * f + (p - 1) * (f + f - f)}
    measured: dict[str, list[float]] = {s: [] for s in ideal}
    # the run's own time of a stage's F + B + W per microbatch (mean over ranks): the layers'
    # waits and the runtime's work around each compute, without the messages between ranks
    stage_ms: dict[str, list[float]] = {s: [] for s in ideal}
    torch_ms: dict[str, list[float]] = {s: [] for s in ideal}
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
                report = json.loads((tmp / "report.json").read_text())
                measured[schedule].append(report["iteration_ms"])
                stage_ms[schedule].append(statistics.mean(
                    r["fwd_ms_per_microbatch"] + r["bwd_ms_per_microbatch"] for r in report["ranks"]))
                if not args.no_torch:
                    torch_ms[schedule].append(run_torch(schedule, env, m, 2, args.steps, tmp))
    rows = []
    for s in ideal:
        med = statistics.median(measured[s])
        at_stage = ideal[s] * statistics.median(stage_ms[s]) / (3 * f)  # F = B = W
        rows.append({"schedule": s, "ideal_ms": ideal[s], "measured_ms": measured[s],
                     "median_ms": med, "ratio_to_ideal": med / ideal[s],
                     "stage_ms": stage_ms[s], "ideal_at_measured_stage_ms": at_stage,
                     "ratio_to_ideal_at_measured_stage": med / at_stage,
                     "predicted_ms": predicted[s], "prediction_error": predicted[s] / med - 1,
                     "torch_ms": torch_ms[s],
                     "torch_median_ms": statistics.median(torch_ms[s]) if torch_ms[s] else None})
    one, zb = rows[0]["median_ms"], rows[1]["median_ms"]
    gain = {"theoretical_ms": ideal["1f1b"] - ideal["zb-h1"], "measured_ms": one - zb,
            "share_of_theoretical": (one - zb) / (ideal["1f1b"] - ideal["zb-h1"])}
    header = ("schedule", "ideal ms", "measured ms (median)", "runs", "measured/ideal",
              "F+B+W measured ms", "measured / ideal at that stage time",
              "predicted ms", "predicted/measured - 1", "torch ms (median)")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['ideal_ms']:.1f} | {r['median_ms']:.1f} | "
                     f"{', '.join(f'{x:.1f}' for x in r['measured_ms'])} | {r['ratio_to_ideal']:.3f} | "
                     f"{statistics.median(r['stage_ms']):.2f} | {r['ratio_to_ideal_at_measured_stage']:.3f} | "
                     f"{r['predicted_ms']:.1f} | {r['prediction_error']:+.3f} | "
                     + (f"{r['torch_median_ms']:.1f} |" if r["torch_median_ms"] is not None else "- |"))
    print("\n".join(lines))
    print(f"ZB-H1 gain over 1F1B: {gain['measured_ms']:.1f} ms measured of {gain['theoretical_ms']:.1f} ms "
          f"in theory ({100 * gain['share_of_theoretical']:.0f} %)")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(
        {"command": " ".join(["python", *sys.argv]), "f_ms": f, "microbatches": m, "stages": p,
         "rows": rows, "gain": gain}, indent=2) + "\n")


if __name__ == "__main__":
    main()
