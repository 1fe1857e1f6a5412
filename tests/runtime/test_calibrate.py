"""`python -m runtime calibrate`: a real run over gloo writes a cluster.json the planner loads,
with measured latency and bandwidth; the alpha-beta fit and the cluster form are checked on
data with a known answer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from runtime_paths import MODELS

from planner.formats import Cluster
from runtime.calibrate import cluster_from, fit_alpha_beta, format_summary
from runtime.pipeline_probe import fit_overhead

ROOT = Path(__file__).resolve().parents[2]


def _calibrate(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "runtime", "calibrate", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_alpha_beta_fit_recovers_the_line():
    alpha, gbps = 180.0, 2.5  # us, GB/s
    points = [(float(n), alpha + n / (gbps * 1e3)) for n in (256, 4096, 65536, 1 << 20, 4 << 20)]
    a, g = fit_alpha_beta(points)
    assert a == pytest.approx(alpha, rel=1e-6) and g == pytest.approx(gbps, rel=1e-6)
    # noise of a few percent moves the fit by about as much, never to a negative latency
    noisy = [(n, t * (1.04 if i % 2 else 0.97)) for i, (n, t) in enumerate(points)]
    a, g = fit_alpha_beta(noisy)
    assert 150 < a < 210 and 2.2 < g < 2.9


def _meas(ranks_of_node, speeds, links):
    return {"ranks_of_node": ranks_of_node, "speeds": speeds,
            "memory_bytes": [8e9] * len(speeds), "links": links, "allreduce": {"efficiency": 0.5},
            "node_names": [f"n{i}" for i in range(len(ranks_of_node))], "backend": "gloo",
            "device": "cpu", "device_name": "cpu", "speed_workload": "reference MLP",
            "speed_reference_ms": 10.0, "together_ms": [20.0] * len(speeds)}


def test_cluster_forms():
    intra = {"latency_us": 30.0, "gb_per_s": 100.0}
    inter = {"latency_us": 90.0, "gb_per_s": 12.0}
    # two equal nodes: the uniform form, both classes, latency_us the smaller one
    c = Cluster.model_validate(cluster_from(_meas([[0, 1], [2, 3]], [0.5] * 4,
                                                  {"intra": intra, "inter": inter})))
    assert c.nodes == 2 and c.devices_per_node == 2 and c.speed == 0.5
    assert (c.intra_node_latency_us, c.inter_node_latency_us, c.latency_us) == (30.0, 90.0, 30.0)
    assert (c.intra_node_gb_per_s, c.inter_node_gb_per_s, c.allreduce_efficiency) == (100.0, 12.0, 0.5)
    # nodes of different speed: the list form
    c = Cluster.model_validate(cluster_from(_meas([[0, 1], [2, 3]], [1.0, 1.0, 0.5, 0.5],
                                                  {"intra": intra, "inter": inter}), memory_gb=2.0))
    assert [(n.devices, n.speed, n.device_memory_gb) for n in c.nodes] == [(2, 1.0, 2.0), (2, 0.5, 2.0)]
    summary = format_summary(c.model_dump(exclude_none=True), None).splitlines()
    memory = next(ln for ln in summary if ln.startswith("memory per device"))
    assert f"{c.nodes[0].name} 2, {c.nodes[1].name} 2" in memory  # per node, as the speed line
    # one rank per node: the same-node class takes the cross-node figures
    c = Cluster.model_validate(cluster_from(_meas([[0], [1]], [1.0, 1.0], {"inter": inter})))
    assert c.intra_node_latency_us == 90.0
    # one rank: no link measured, and the summary does not print the file's placeholders as
    # measured (it printed 1000000 GB/s and 0 us)
    one = Cluster.model_validate(cluster_from(_meas([[0]], [1.0], {})))
    summary = format_summary(one.model_dump(exclude_none=True), None)
    assert "bandwidth" not in summary and "latency" not in summary and "no link measured" in summary


def test_calibrate_two_local_ranks(tmp_path):
    out = tmp_path / "cluster.json"
    nominal = ROOT / "examples" / "cpu_cluster.json"
    r = _calibrate("--nproc-per-node", "2", "-o", str(out), "--rounds", "4", "--nominal", str(nominal))
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    c = Cluster.model_validate(data)
    assert c.num_devices == 2
    assert c.intra_node_latency_us is not None and c.intra_node_latency_us > 0
    assert 0 < c.intra_node_gb_per_s < 1e5 and 0 < c.speed <= 2 and 0 < c.allreduce_efficiency <= 1
    cal = c.calibration or {}
    assert cal["backend"] == "gloo" and len(cal["links"]["intra"]["points_us"]) == 6
    assert all(t > 0 for _, t in cal["links"]["intra"]["points_us"])
    assert len(cal["speeds"]) == 2 and c.device_memory_gb > 0
    assert "same-node latency" in r.stdout and "nominal" in r.stdout and "wrote" in r.stdout
    # progress while it measures (64 ranks on 2 cores take minutes)
    assert r.stdout.index("all-reduce over 2 ranks ...") < r.stdout.index("pipeline ...") < r.stdout.index("wrote")
    # the pipeline probe ran both ranks as a 1F1B chain; its overhead is the fit of what it measured
    probe = cal["pipeline"]
    assert len(probe["fwd_ms"]) == len(probe["bwd_ms"]) == 2 and min(probe["fwd_ms"] + probe["bwd_ms"]) > 0
    assert probe["iteration_ms"] > 0 and c.p2p_overhead_us >= 0
    refit = fit_overhead(probe["fwd_ms"], probe["bwd_ms"], probe["microbatches"], probe["bytes"],
                         probe["hops"], probe["iteration_ms"])
    assert c.p2p_overhead_us == pytest.approx(refit, abs=0.06)
    assert "per-message overhead" in r.stdout


def test_calibrate_two_nodes_under_torchrun(tmp_path):
    """Two torchrun agents of two ranks each on this machine stand for two nodes (torchrun's
    GROUP_RANK tells them apart): the same-node pair and then the cross-node pair are measured.
    The cross-node pair's tags once depended on which ranks had measured the first pair, and
    ranks 0 and 2 waited for each other's messages until the timeout."""
    from runtime.launch import free_port

    out = tmp_path / "cluster.json"
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "-m", "runtime", "calibrate", "-o", str(out), "--rounds", "3", "--timeout", "30",
         "--memory-gb", "2"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for node in (0, 1)]
    logs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs[0][1][-3000:] + logs[1][1][-3000:]
    c = Cluster.model_validate(json.loads(out.read_text()))
    assert [(n.devices, n.device_memory_gb) for n in c.node_specs()] == [(2, 2.0), (2, 2.0)]
    links = (c.calibration or {})["links"]
    assert links["intra"]["ranks"] == [0, 1] and links["inter"]["ranks"] == [0, 2]
    assert c.inter_node_latency_us is not None and c.inter_node_latency_us > 0
    assert "cross-node latency" in logs[0][0] and "memory per device (GB)" in logs[0][0]


def test_calibrate_with_the_profiled_model(tmp_path):
    from planner.cli import main

    prof = tmp_path / "profile.json"
    assert main(["profile", str(MODELS / "seq_mlp.py"), "--batch-size", "4", "--threads", "1",
                 "-q", "-o", str(prof)]) == 0
    out = tmp_path / "cluster.json"
    r = _calibrate("--nproc-per-node", "2", "-o", str(out), "--rounds", "3", "--profile", str(prof),
                   "--model", str(MODELS / "seq_mlp.py"), "--memory-gb", "0.5")
    assert r.returncode == 0, r.stderr
    c = Cluster.model_validate_json(out.read_text())
    cal = c.calibration or {}
    assert c.device_memory_gb == 0.5 and cal["speed_workload"] == "profile"
    # profiled on this very CPU: the speed is against the same work run alone here
    assert cal["same_device_as_profiled"] is True and cal["speed_reference_ms"] == cal["solo_ms"]
    assert c.speed > 0


def test_bad_arguments_are_one_line_errors(tmp_path):
    r = _calibrate("--profile", "p.json", "-o", str(tmp_path / "c.json"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "--model" in r.stderr
    r = _calibrate("--nproc-per-node", "1", "--nominal", str(tmp_path / "missing.json"))
    assert r.returncode == 2 and "no such file" in r.stderr
    # a model that is not there: refused before the ranks start (each found it after the launch)
    from tests.planner.helpers import chain_profile

    (tmp_path / "p.json").write_text(chain_profile([1.0, 2.0]).model_dump_json())
    r = _calibrate("--nproc-per-node", "2", "--profile", str(tmp_path / "p.json"), "--model",
                   str(tmp_path / "none.py"), "-o", str(tmp_path / "c.json"))
    assert r.returncode == 2 and "--model" in r.stderr and "no such file" in r.stderr, r.stderr
    assert "calibrating" not in r.stdout
    # the cluster format's bound on memory: refused first, not after the ranks measured
    r = _calibrate("--nproc-per-node", "1", "--memory-gb", "2e6", "-o", str(tmp_path / "c.json"))
    assert r.returncode == 2 and "--memory-gb 2e+06" in r.stderr and "at most 1e+06" in r.stderr, r.stderr
    assert "calibrating" not in r.stdout and "Traceback" not in r.stderr
    # below what every reader of a cluster file takes (1e-6 GB): it wrote a file plan refused
    r = _calibrate("--nproc-per-node", "1", "--memory-gb", "1e-12", "-o", str(tmp_path / "c.json"))
    assert r.returncode == 2 and "--memory-gb 1e-12" in r.stderr and "at least 1e-06" in r.stderr, r.stderr
    assert not (tmp_path / "c.json").exists()


def test_one_rank_is_its_own_reference_speed_and_the_file_is_replaced_whole(tmp_path):
    """With one rank, alone and with all ranks busy are one and the same: its speed is 1 (two
    timings of the same work wrote 0.03 to 4.8 on a busy machine, and plans on those files were
    off as much). The file is renamed in from a temporary one: a write that fails keeps the old."""
    out = tmp_path / "c.json"
    r = _calibrate("--nproc-per-node", "1", "-o", str(out), "--rounds", "2", "--memory-gb", "1")
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert data["speed"] == 1.0 and data["calibration"]["speeds"] == [1.0], data
    assert [p.name for p in tmp_path.iterdir()] == ["c.json"]  # no temporary file left
