"""A run of days: what each rank keeps for its report stays bounded however many steps it takes.

An outside review ran 12,000 steps of a 2-stage, 3-rank zb-h1 plan (4 microbatches): every rank's
RSS grew linearly, by ~340 B a step on the ranks of stage 1 and ~790 B on rank 0 (each
microbatch's forward and backward time and four per-step timings kept as Python floats, ~32
bytes each, all of them sent to rank 0 at the end): ~9 GB on rank 0 after three days of 20 ms
steps. Now only the last `timing_window_steps()` to twice as many steps' timings are kept; every
step's time and loss (the report's `step_ms` and `losses`) 8 bytes each."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from runtime_paths import MODELS

from runtime.report import RankRecord, build_report, trim_timings


def test_the_timings_a_rank_keeps_stay_bounded_over_many_steps():
    window, m = 50, 8
    step_ms, comm, idle, opt, fwd, bwd = [], [], [], [], [], []
    dropped = 0
    for s in range(100_000):
        fwd.extend([1.0] * m)
        bwd.extend([2.0 + (s % 3)] * m)
        for xs in (step_ms, comm, idle, opt):
            xs.append(float(s))
        dropped += trim_timings((comm, idle, opt), ((fwd, m), (bwd, m)), window)
        assert len(comm) <= 2 * window and len(fwd) == m * len(comm) == len(bwd)
    assert dropped == 100_000 - len(comm) and comm[-1] == 99_999.0  # the newest steps are kept
    assert comm == [float(s) for s in range(100_000 - len(comm), 100_000)]
    record = RankRecord(rank=0, stage=0, replica=0, step_ms=[], fwd_ms=fwd, bwd_ms=bwd, comm_ms=comm,
                        idle_ms=idle, optimizer_ms=opt, peak_memory_bytes=0, memory_measure="",
                        peak_inflight=1, peak_activation_bytes=0, dropped_steps=dropped)
    assert len(pickle.dumps(record)) < 50_000  # (it held 1.6 M floats: ~15 MB pickled)


def test_a_report_after_trimming_takes_the_medians_of_the_steps_kept(run, tmp_path):
    """Medians over the kept steps, the first step's microbatches not skipped twice."""
    from planner.formats import Plan
    from planner.io import load_model

    plan = load_model(run.plan(MODELS / "seq_mlp.py", 2), Plan, "plan")
    rec = RankRecord(rank=0, stage=0, replica=0, step_ms=[9.0] * 10, fwd_ms=[1.0, 3.0, 1.0, 3.0],
                     bwd_ms=[2.0, 2.0, 4.0, 4.0], comm_ms=[0.5, 0.7], idle_ms=[0.1, 0.3],
                     optimizer_ms=[1.0, 2.0], peak_memory_bytes=0, memory_measure="", peak_inflight=1,
                     peak_activation_bytes=0, dropped_steps=8)
    report = build_report(plan, [rec], [1.0] * 10, 10, {})
    assert report.step_ms == [9.0] * 10 and report.ranks[0].fwd_ms_per_microbatch == 2.0
    assert report.ranks[0].bwd_ms_per_microbatch == 3.0


def test_training_is_the_same_whether_old_timings_are_dropped_or_not(run, tmp_path, monkeypatch):
    """zb-h1 with split backwards (a W adds its time to its B's entry, by index) and replicas:
    a window of 2 steps trims every few steps; training, the report's steps and losses are those
    of the run that keeps every timing."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2, [1, 2], schedule="zb-h1", global_batch=8, microbatch_size=2)
    out = {}
    for window in ("2", "100000"):
        monkeypatch.setenv("PIPEPLAN_TIMING_WINDOW_STEPS", window)
        rc, _, err, _ = run(plan, "--model", model, "--steps", 12, "--seed", 3,
                            "--save", tmp_path / f"ck{window}", "--report", tmp_path / f"r{window}.json",
                            "--timeout", 60)
        assert rc == 0, err
        out[window] = json.loads((tmp_path / f"r{window}.json").read_text())
        assert len(out[window]["step_ms"]) == 12 and len(out[window]["losses"]) == 12
        assert all(r["fwd_ms_per_microbatch"] > 0 and r["bwd_ms_per_microbatch"] > 0
                   for r in out[window]["ranks"])
    assert out["2"]["losses"] == out["100000"]["losses"]
    a = torch.load(tmp_path / "ck2" / "model.pt")
    b = torch.load(tmp_path / "ck100000" / "model.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_second_run_saving_into_the_same_directory_is_refused_while_the_first_runs(run, tmp_path):
    """Two jobs with one --save directory (a job started twice, a scheduler's retry while the
    first still ran) wrote the same *.tmp files: with --save-every 1 one of them failed with a
    traceback (FileNotFoundError renaming model.pt.tmp, the other had renamed it) and their
    files could mix. The second is refused now, naming the first's pid; once the first ends the
    directory is free again."""
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    ck = tmp_path / "ck"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    first = subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                              "--steps", "1000000", "--threads", "1", "--save", str(ck),
                              "--save-every", "1000"], cwd=root, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not subprocess.run(
                ["pgrep", "-P", str(first.pid)], capture_output=True).stdout:
            time.sleep(0.3)
        rc, out, err, _ = run(plan, "--model", model, "--steps", 2, "--save", ck)
        assert rc == 2 and f"another run (pid {first.pid}) is saving its checkpoints there" in err, err
        assert "Traceback" not in err and "step 1" not in out
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--save", ck)
    assert rc == 0, err
    assert (ck / "model.pt").is_file()


def test_the_launchers_store_listens_on_this_machine_only(run):
    """The launcher's rendezvous store (TCPStore, unauthenticated: the ranks' addresses and the
    run's own keys) listened on every interface (*:PORT), reachable from the whole network for a
    run that never leaves this machine; now on 127.0.0.1 only."""
    if not shutil.which("ss"):
        pytest.skip("needs ss (iproute2)")
    model = MODELS / "seq_mlp.py"
    plan = run.plan(model, 2)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    launcher = subprocess.Popen([sys.executable, "-m", "runtime", str(plan), "--model", str(model),
                                 "--steps", "1000000", "--threads", "1"], cwd=root,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline, mine = time.time() + 60, []
        while time.time() < deadline and not mine:
            time.sleep(0.5)
            lines = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout.splitlines()
            mine = [line.split()[3] for line in lines if f"pid={launcher.pid}," in line]
        assert mine, "the launcher's store did not listen"
        assert all(addr.startswith("127.0.0.1:") for addr in mine), mine
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.communicate(timeout=60)
