"""On a machine with a GPU: profile with CUDA events, a one-rank CUDA run's peak memory against
the plan, and calibrating a GPU's speed against a CPU profile. Skipped without CUDA (CI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from runtime_paths import EXAMPLES

from planner.cli import main as planner_main
from planner.formats import Cluster, Profile

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parents[2]


def _profile(tmp: Path, device: str, name: str) -> Profile:
    out = tmp / name
    assert planner_main(["profile", str(EXAMPLES / "gpt.py"), "--batch-size", "8", "--device", device,
                         "-q", "-o", str(out)]) == 0
    return Profile.model_validate_json(out.read_text())


def test_cuda_profile_layers_sum_to_the_whole_model(tmp_path):
    p = _profile(tmp_path, "cuda", "gpu.json")
    assert p.device.type == "cuda" and p.measured is not None
    assert p.device.workspace_bytes >= 2**20  # cuBLAS's workspaces (64 MiB on an H100)
    layers = sum(x.fwd_ms + x.bwd_ms for x in p.layers)
    whole = p.measured.fwd_ms + p.measured.bwd_ms
    assert 0.5 < layers / whole < 2.0, (layers, whole)


@pytest.mark.parametrize("recompute", ["0", "1"])
def test_one_rank_cuda_plan_peak_memory_matches_the_prediction(tmp_path, run, recompute):
    p = _profile(tmp_path, "cuda", "gpu.json")
    cluster = tmp_path / "cluster.json"
    cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": 1, "device_memory_gb": 16,
                                   "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25}))
    plan = tmp_path / "plan.json"
    assert planner_main(["plan", str(tmp_path / "gpu.json"), "--cluster", str(cluster), "--global-batch", "16",
                         "--microbatch-size", "8", "--method", "manual", "--split", str(len(p.layers)),
                         "--recompute", recompute, "-o", str(plan)]) == 0
    rc, _, err, _ = run(plan, "--model", EXAMPLES / "gpt.py", "--steps", 3, "--optimizer", "adam",
                        "--report", tmp_path / "report.json")
    assert rc == 0, err
    rank = json.loads((tmp_path / "report.json").read_text())["ranks"][0]
    assert rank["memory_measure"] == "cuda_max_allocated"
    print(f"recompute={recompute}: peak {rank['peak_memory_bytes']} B, predicted "
          f"{rank['predicted_memory_bytes']} B, ratio "
          f"{rank['peak_memory_bytes'] / rank['predicted_memory_bytes']:.3f}")
    # the prediction includes cuBLAS's workspaces (the profile's device.workspace_bytes); the
    # allocator rounds blocks up and the optimizer's and loss's temporaries are not modelled:
    # within 30 % (H100, before the workspaces were counted: 6.4x and 7.9x)
    assert rank["peak_memory_bytes"] == pytest.approx(rank["predicted_memory_bytes"], rel=0.3)


def test_calibrate_one_gpu_against_a_cpu_profile(tmp_path):
    _profile(tmp_path, "cpu", "cpu.json")
    out = tmp_path / "cluster.json"
    r = subprocess.run([sys.executable, "-m", "runtime", "calibrate", "--nproc-per-node", "1",
                        "-o", str(out), "--profile", str(tmp_path / "cpu.json"),
                        "--model", str(EXAMPLES / "gpt.py")],
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    c = Cluster.model_validate_json(out.read_text())
    assert (c.calibration or {})["backend"] == "nccl" and c.speed > 0
