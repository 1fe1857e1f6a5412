"""Does pipeplan's runtime execute 1F1B as fast as the schedule allows — and as fast as PyTorch's?

Two CPU cores cannot show compute running in parallel, so this measures the schedule itself on
a *sleep model*: every layer is a small Linear followed by a custom autograd function that
sleeps F ms in forward and 2F ms in backward. With one layer per stage, the ideal 1F1B
iteration is exactly `(m + S - 1) * 3F`. For S = 2, 4 and m = 8, 16 (F = 5 ms) it measures:

- pipeplan's runtime (`python -m runtime`) with 1F1B, against that ideal (target >= 95%);
- `torch.distributed.pipelining.Schedule1F1B` on the same model and split (target: pipeplan
  no slower);
- the simulator's prediction for the plan (a profile whose times are the sleep times) against
  the measured time (target within 5%): on the nominal cluster (latency-free links) and on one
  whose `latency_us` is gloo's one-way latency to a receiver blocked for F ms (timestamped
  messages between two processes, measured right before each row); the ping-pong latency and
  the per-hop delay seen in the run's own trace are reported beside it;
- GPipe against 1F1B: time and peak saved-activation bytes of stage 0.

Times are medians over the steps after the first of rank 0's wall time per step.

    .venv/bin/python benchmarks/runtime.py [--steps 8] [--f-ms 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# this script is named like the runtime package (and a sibling like the planner): import the
# packages, not the scripts beside this one
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "runtime.json"

SLEEP_MODEL = '''"""Sleep model: each layer a Linear, then F ms asleep in forward and 2F ms in backward."""
import os
import time

import torch
from torch import nn

LAYERS = int(os.environ.get("PIPEPLAN_SLEEP_LAYERS", "4"))
F_MS = float(os.environ.get("PIPEPLAN_SLEEP_F_MS", "5"))
DIM = int(os.environ.get("PIPEPLAN_SLEEP_DIM", "64"))


# time.sleep overshoots by ~0.1 ms here when a core is free: spin only the last 0.2 ms, so
# four ranks on two cores steal little CPU from one another (the wait is still exactly F / 2F)
SPIN_MS = float(os.environ.get("PIPEPLAN_SLEEP_SPIN_MS", "0.2"))


def wait_ms(ms):
    """Sleep most of the time, spin the last SPIN_MS milliseconds: time.sleep alone overshoots."""
    deadline = time.perf_counter() + ms / 1e3
    if ms > SPIN_MS:
        time.sleep((ms - SPIN_MS) / 1e3)
    while time.perf_counter() < deadline:
        pass


class Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        wait_ms(F_MS)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        wait_ms(2 * F_MS)
        return g


def sleep_op(x):
    return Sleep.apply(x)


torch.fx.wrap("sleep_op")  # opaque to torch.fx, so the sleeps stay in the traced graph


class SleepLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x):
        return sleep_op(self.lin(x))


def build_model():
    return nn.Sequential(*[SleepLayer() for _ in range(LAYERS)])


def make_batch(batch_size):
    return (torch.randn(batch_size, DIM),), torch.randn(batch_size, DIM)


def loss_fn(out, target):
    return ((out - target) ** 2).mean()
'''


def sleep_env(S: int, f_ms: float, dim: int) -> dict[str, str]:
    return {"PIPEPLAN_SLEEP_LAYERS": str(S), "PIPEPLAN_SLEEP_F_MS": str(f_ms),
            "PIPEPLAN_SLEEP_DIM": str(dim)}


def sleep_plan(model_path: Path, S: int, m: int, b: int, f_ms: float, dim: int, schedule: str,
               latency_us: float = 0.0):
    """A profile whose layer times are the sleep times, planned one layer per stage, on a
    cluster whose links have `latency_us` per message (0: the nominal, latency-free cluster)."""
    import torch

    from planner.formats import Cluster, DeviceInfo, LayerProfile, ModelRef, PlanOptions, Profile
    from planner.solve import make_plan
    from profiler.loader import file_sha256, load_model_file
    from runtime import stages

    mf = load_model_file(model_path)
    torch.manual_seed(0)
    (x,), _ = mf.make_batch(b)
    lg = stages.trace_model(mf.build_model(), (x,), "blocks")
    act = b * dim * 4
    profile = Profile(
        model=ModelRef(path=str(model_path), sha256=file_sha256(model_path)),
        device=DeviceInfo(type="cpu", name="sleep model"), batch_size=b,
        layers=[LayerProfile(name=n, fwd_ms=f_ms, bwd_ms=2 * f_ms, param_bytes=(dim * dim + dim) * 4,
                             activation_bytes=act, output_bytes=act) for n in lg.layer_names()],
        edges=lg.edges(),
    )
    cluster = Cluster(nodes=1, devices_per_node=S, device_memory_gb=1, intra_node_gb_per_s=1000,
                      inter_node_gb_per_s=1000, latency_us=latency_us)
    options = PlanOptions(global_batch=m * b, microbatch_size=b, schedule=schedule,  # type: ignore[arg-type]
                          method="manual", split=[1] * S, replicas=[1] * S, optimizer="sgd")
    return make_plan(profile, cluster, options)


def run_pipeplan(plan, model_path: Path, env: dict[str, str], steps: int, tmp: Path) -> dict:
    from planner.io import save_model

    plan_path = tmp / f"plan-{plan.schedule}.json"
    report_path = tmp / f"report-{plan.schedule}.json"
    trace_path = tmp / f"trace-{plan.schedule}.json"
    save_model(plan, plan_path)
    cmd = [sys.executable, "-m", "runtime", str(plan_path), "--model", str(model_path),
           "--steps", str(steps), "--lr", "0", "--optimizer", "sgd", "--report", str(report_path),
           "--trace", str(trace_path)]
    subprocess.run(cmd, env=dict(os.environ, **env), check=True, cwd=ROOT, capture_output=True)
    rep = json.loads(report_path.read_text())
    rep["hop_us"] = hop_latency_us(json.loads(trace_path.read_text()))
    return rep


def hop_latency_us(trace: dict) -> float | None:
    """Median delay, in the last step's measured trace, between a stage finishing F(s-1, j)
    (or B(s+1, j)) and the next stage starting F(s, j) (or B(s, j)), counted only where that
    message was what the next stage waited for (it had finished its previous action earlier):
    the per-hop latency the run itself saw, wake-ups under load included. A diagnostic of the
    run, not an input to its prediction."""
    evs = trace["traceEvents"] if isinstance(trace, dict) else trace
    rows = [e for e in evs if e.get("ph") == "X" and e.get("pid") == 0 and e.get("cat") in ("F", "B")]
    by_name = {e["name"]: e for e in rows}
    prev_end: dict[str, float] = {}
    for tid in {e["tid"] for e in rows}:
        mine = sorted((e for e in rows if e["tid"] == tid), key=lambda e: e["ts"])
        for a, b in zip(mine, mine[1:], strict=False):
            prev_end[b["name"]] = a["ts"] + a["dur"]
    gaps = []
    for e in rows:
        st, kind, mb = e["name"].partition(e["cat"])
        src = f"{int(st) - 1}F{mb}" if kind == "F" else f"{int(st) + 1}B{mb}"
        if src not in by_name:
            continue
        ready = by_name[src]["ts"] + by_name[src]["dur"]
        if ready > prev_end.get(e["name"], float("-inf")):
            gaps.append(e["ts"] - ready)
    return float(statistics.median(gaps)) if gaps else None


def simulate_with_measured(plan, report: dict) -> float:
    """The simulator's iteration time for the plan with the stage times the run measured."""
    import dataclasses

    from planner.schedules import plan_actions
    from planner.simulator import costs_from_plan, simulate_costs

    by_stage: dict[int, dict] = {}
    for r in report["ranks"]:
        by_stage.setdefault(r["stage"], r)
    costs = dataclasses.replace(
        costs_from_plan(plan),
        fwd_ms=tuple(by_stage[s]["fwd_ms_per_microbatch"] for s in range(len(plan.stages))),
        bwd_ms=tuple(by_stage[s]["bwd_ms_per_microbatch"] for s in range(len(plan.stages))),
    )
    return simulate_costs(costs, plan_actions(plan)).iteration_ms


# ---------------------------------------------------------------- transport latency


def latency_worker(rounds: int, idle_ms: float, out: str) -> None:
    """One of two ranks sending one microbatch-sized tensor over gloo (isend/irecv + wait, as
    the runtime does). Two ways: a ping-pong (both ranks hot: median round trip / 2), and
    one-way messages that rank 0 sends after `idle_ms` with its `time.time()` inside, so rank 1
    has been blocked in `wait()` that long, as a pipeline stage waiting for its next input is
    (arrival time − stamp). Rank 0 writes both lists in microseconds."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    buf = torch.zeros(int(os.environ["PINGPONG_NUMEL"]), dtype=torch.float64)
    peer = 1 - rank
    hot, cold = [], []
    for i in range(rounds):
        t0 = time.perf_counter()
        if rank == 0:
            dist.isend(buf, peer, tag=i).wait()
        dist.irecv(buf, peer, tag=i).wait()
        if rank == 1:
            dist.isend(buf, peer, tag=i).wait()
        hot.append((time.perf_counter() - t0) * 1e6 / 2)
    for i in range(rounds // 4):
        tag = rounds + i
        if rank == 0:
            time.sleep(idle_ms / 1e3)
            buf[0] = time.time()
            dist.isend(buf, peer, tag=tag).wait()
            dist.irecv(buf[:1], peer, tag=tag).wait()
            cold.append(float(buf[0]))
        else:
            dist.irecv(buf, peer, tag=tag).wait()
            buf[0] = (time.time() - float(buf[0])) * 1e6
            dist.isend(buf[:1], peer, tag=tag).wait()
    if rank == 0:
        Path(out).write_text(json.dumps({"hot": hot, "cold": cold}))
    dist.barrier()
    dist.destroy_process_group()


def measure_latency_us(numel: int, idle_ms: float, tmp: Path, rounds: int = 200) -> tuple[float, float]:
    """gloo's one-way message latency on this machine, (hot, cold): the ping-pong's and the one a
    receiver blocked for `idle_ms` sees (medians; the first 10% dropped as warm-up). The cold
    one is what a pipeline stage waiting for its input pays, and what this benchmark puts into
    its cluster's `latency_us`, as a user would measure their network."""
    from runtime.launch import free_port

    out = tmp / "latency.json"
    port = free_port()
    procs = []
    for r in range(2):
        e = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), OMP_NUM_THREADS="1", PINGPONG_NUMEL=str(numel))
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--latency-worker", str(rounds), str(idle_ms), str(out)],
            env=e, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=300)
        if p.returncode:
            raise RuntimeError(f"latency rank failed:\n{err.decode()[-2000:]}")
    d = json.loads(out.read_text())
    return tuple(float(statistics.median(x[len(x) // 10:])) for x in (d["hot"], d["cold"]))  # type: ignore[return-value]


# ---------------------------------------------------------------- torch.distributed.pipelining


def torch_worker(model_path: str, S: int, m: int, b: int, steps: int, out: str) -> None:
    """One rank of the same model and split under PyTorch's Schedule1F1B."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from profiler.loader import load_model_file

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    mf = load_model_file(model_path)
    torch.manual_seed(0)
    model = mf.build_model()
    (x,), _ = mf.make_batch(b)
    stage = PipelineStage(model[rank], rank, S, torch.device("cpu"), input_args=(x,))
    schedule = Schedule1F1B(stage, m, loss_fn=mf.loss_fn)
    opt = torch.optim.SGD(model[rank].parameters(), lr=0.0)
    times = []
    for s in range(steps):
        torch.manual_seed(s)
        (inputs,), target = mf.make_batch(m * b)
        t0 = time.time()
        if rank == 0:
            schedule.step(inputs)
        elif rank == S - 1:
            schedule.step(target=target)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
        times.append((time.time() - t0) * 1e3)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def run_torch(model_path: Path, env: dict[str, str], S: int, m: int, b: int, steps: int,
              tmp: Path) -> list[float]:
    from runtime.launch import free_port

    out = tmp / "torch.json"
    port = free_port()
    procs = []
    for r in range(S):
        e = dict(os.environ, **env, RANK=str(r), WORLD_SIZE=str(S), LOCAL_RANK=str(r),
                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--torch-worker", str(model_path), str(S), str(m), str(b),
             str(steps), str(out)], env=e, cwd=ROOT, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"torch pipelining rank failed:\n{err.decode()[-2000:]}")
    return json.loads(out.read_text())


# ---------------------------------------------------------------- the table


def median_steady(xs: list[float]) -> float:
    return float(statistics.median(xs[1:] if len(xs) > 1 else xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--f-ms", type=float, default=5.0)
    ap.add_argument("--microbatch-size", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--microbatches", default="8,16")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    f, b, dim = args.f_ms, args.microbatch_size, args.dim
    rows = []
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmpdir:
        tmp = Path(tmpdir)
        model_path = tmp / "sleep_model.py"
        model_path.write_text(SLEEP_MODEL)
        for S in map(int, args.stages.split(",")):
            env = sleep_env(S, f, dim)
            os.environ.update(env)  # the model file reads its sizes at import
            for m in map(int, args.microbatches.split(",")):
                ideal = (m + S - 1) * 3 * f
                plan_1f1b = sleep_plan(model_path, S, m, b, f, dim, "1f1b")
                plan_gpipe = sleep_plan(model_path, S, m, b, f, dim, "gpipe")
                # measured right before the row: it depends on the machine's load at the time
                hot_us, latency_us = measure_latency_us(b * dim // 2, f, tmp)  # float64: b x dim floats
                plan_lat = sleep_plan(model_path, S, m, b, f, dim, "1f1b", latency_us)
                rep = run_pipeplan(plan_1f1b, model_path, env, args.steps, tmp)
                rep_g = run_pipeplan(plan_gpipe, model_path, env, args.steps, tmp)
                torch_ms = median_steady(run_torch(model_path, env, S, m, b, args.steps, tmp))
                stage_ms = max(r["fwd_ms_per_microbatch"] + r["bwd_ms_per_microbatch"]
                               for r in rep["ranks"])
                ours = rep["iteration_ms"]
                pred = plan_1f1b.predicted.iteration_ms
                rows.append({
                    "S": S, "m": m, "ideal_ms": ideal,
                    "pipeplan_1f1b_ms": ours, "pipeplan_pct_of_ideal": 100 * ideal / ours,
                    "measured_stage_ms": stage_ms,
                    "ideal_with_measured_stage_ms": (m + S - 1) * stage_ms,
                    "pipeplan_pct_of_measured_ideal": 100 * (m + S - 1) * stage_ms / ours,
                    "torch_1f1b_ms": torch_ms, "torch_pct_of_ideal": 100 * ideal / torch_ms,
                    "predicted_ms": pred, "prediction_error_pct": 100 * (pred - ours) / ours,
                    "predicted_with_measured_stage_ms": simulate_with_measured(plan_1f1b, rep),
                    "latency_us": latency_us, "pingpong_latency_us": hot_us,
                    "hop_us_in_run": rep["hop_us"],
                    "predicted_latency_ms": plan_lat.predicted.iteration_ms,
                    "prediction_latency_error_pct": 100 * (plan_lat.predicted.iteration_ms - ours) / ours,
                    "predicted_latency_measured_stage_ms": simulate_with_measured(plan_lat, rep),
                    "pipeplan_gpipe_ms": rep_g["iteration_ms"],
                    "predicted_gpipe_ms": plan_gpipe.predicted.iteration_ms,
                    "act_bytes_stage0_1f1b": rep["ranks"][0]["peak_activation_bytes"],
                    "act_bytes_stage0_gpipe": rep_g["ranks"][0]["peak_activation_bytes"],
                    "inflight_stage0_1f1b": rep["ranks"][0]["peak_inflight_microbatches"],
                    "inflight_stage0_gpipe": rep_g["ranks"][0]["peak_inflight_microbatches"],
                    "pipeplan_step_ms": rep["step_ms"], "steps": args.steps,
                })
                r = rows[-1]
                print(f"S={S} m={m}: ideal {ideal:.0f} ms, pipeplan {ours:.1f} ms "
                      f"({r['pipeplan_pct_of_ideal']:.1f}%), torch {torch_ms:.1f} ms "
                      f"({r['torch_pct_of_ideal']:.1f}%), predicted {pred:.1f} ms, with latency "
                      f"{r['predicted_latency_ms']:.1f} ms ({latency_us:.0f} us)", flush=True)
    load_after = os.getloadavg()
    header = ("| S | m | ideal ms | pipeplan 1F1B ms | % of ideal | % of ideal (measured stage time) "
              "| torch Schedule1F1B ms | % of ideal | simulator ms | sim − measured | "
              "simulator, measured stage times | gloo latency us hot / cold / in run | simulator with latency (error) | "
              "with latency and measured stage times (error) | GPipe ms | "
              "act. bytes stage 0 1F1B / GPipe (in flight) |")
    lines = [header, "|" + "---|" * 16]
    for r in rows:
        lines.append(
            f"| {r['S']} | {r['m']} | {r['ideal_ms']:.0f} | {r['pipeplan_1f1b_ms']:.1f} | "
            f"{r['pipeplan_pct_of_ideal']:.1f}% | {r['pipeplan_pct_of_measured_ideal']:.1f}% | "
            f"{r['torch_1f1b_ms']:.1f} | {r['torch_pct_of_ideal']:.1f}% | {r['predicted_ms']:.1f} | "
            f"{r['prediction_error_pct']:+.1f}% | {r['predicted_with_measured_stage_ms']:.1f} "
            f"({100 * (r['predicted_with_measured_stage_ms'] - r['pipeplan_1f1b_ms']) / r['pipeplan_1f1b_ms']:+.1f}%) | "
            f"{r['pingpong_latency_us']:.0f} / {r['latency_us']:.0f} / {r['hop_us_in_run'] or 0:.0f} | {r['predicted_latency_ms']:.1f} ({r['prediction_latency_error_pct']:+.1f}%) | "
            f"{r['predicted_latency_measured_stage_ms']:.1f} "
            f"({100 * (r['predicted_latency_measured_stage_ms'] - r['pipeplan_1f1b_ms']) / r['pipeplan_1f1b_ms']:+.1f}%) | "
            f"{r['pipeplan_gpipe_ms']:.1f} | "
            f"{r['act_bytes_stage0_1f1b']} / {r['act_bytes_stage0_gpipe']} "
            f"({r['inflight_stage0_1f1b']} / {r['inflight_stage0_gpipe']}) |")
    table = "\n".join(lines)
    print(table)
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} "
          f"(1-minute; {os.cpu_count()} cores)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({
        "f_ms": f, "microbatch_size": b, "dim": dim, "steps": args.steps, "rows": rows,
        "loadavg_before": load_before, "loadavg_after": load_after, "cpu_count": os.cpu_count(),
        "table": table,
    }, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--torch-worker":
        _, _, path, S_, m_, b_, steps_, out_ = sys.argv
        torch_worker(path, int(S_), int(m_), int(b_), int(steps_), out_)
    elif len(sys.argv) > 1 and sys.argv[1] == "--latency-worker":
        latency_worker(int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
    else:
        main()
