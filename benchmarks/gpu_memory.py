"""On a GPU: a one-rank CUDA run's measured peak memory (torch.cuda.max_memory_allocated) against
the plan's prediction, for the examples at small and large sizes, with and without
recomputation, and the memory CUDA libraries keep for themselves (cuBLAS workspaces: one per
thread and stream, so one for the forward's thread and one for autograd's) measured apart.

    python benchmarks/gpu_memory.py [-o benchmarks/results/gpu_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "gpt": {},
    "gpt-large": {"PIPEPLAN_GPT_BLOCKS": "8", "PIPEPLAN_GPT_DIM": "1024", "PIPEPLAN_GPT_HEADS": "16",
                  "PIPEPLAN_GPT_SEQ": "512", "PIPEPLAN_GPT_VOCAB": "32000"},
    "mlp-large": {"PIPEPLAN_MLP_BLOCKS": "8", "PIPEPLAN_MLP_DIM": "4096"},
}
# in a process of its own: the workspaces of a process that ran matmuls before are counted already
PROBE = ("import torch; from profiler.measure import library_workspace_bytes; "
         "print(library_workspace_bytes(torch.device('cuda')))")


def sh(*args: str, env: dict[str, str] | None = None) -> None:
    r = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{args} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")


def fail(message: str) -> NoReturn:
    print(f"gpu_memory: {message}", file=sys.stderr)
    raise SystemExit(2)


def probe_workspace_bytes() -> int:
    """PROBE in a process of its own; no CUDA GPU, or a failed probe: one line, exit 2."""
    import torch

    if not torch.cuda.is_available():
        fail("needs a CUDA GPU: torch.cuda.is_available() is False here")
    probe = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or [f"exit status {probe.returncode}"])[-1]
        fail(f"the cuBLAS workspace probe failed: {last}")
    return int(probe.stdout.split()[-1])


def row(name: str, sizes: dict[str, str], recompute: str, tmp: Path) -> dict:
    env = dict(os.environ, **sizes)
    model = name.split("-")[0]
    prof, plan, rep = tmp / f"{name}.json", tmp / f"{name}-{recompute}-plan.json", tmp / f"{name}-{recompute}-r.json"
    if not prof.exists():
        sh("-m", "planner", "profile", str(ROOT / "examples" / f"{model}.py"), "--batch-size", "8",
           "--device", "cuda", "-q", "-o", str(prof), env=env)
    n = len(json.loads(prof.read_text())["layers"])
    cluster = tmp / "cluster.json"
    cluster.write_text(json.dumps({"nodes": 1, "devices_per_node": 1, "device_memory_gb": 80,
                                   "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25}))
    sh("-m", "planner", "plan", str(prof), "--cluster", str(cluster), "--global-batch", "16",
       "--microbatch-size", "8", "--method", "manual", "--split", str(n), "--recompute", recompute,
       "-o", str(plan), env=env)
    sh("-m", "runtime", str(plan), "--model", str(ROOT / "examples" / f"{model}.py"), "--steps", "3",
       "--optimizer", "adam", "--report", str(rep), env=env)
    r = json.loads(rep.read_text())["ranks"][0]
    st = json.loads(plan.read_text())["stages"][0]["predicted"]
    return {"model": name, "recompute": recompute, "peak": r["peak_memory_bytes"],
            "predicted": r["predicted_memory_bytes"], "measure": r["memory_measure"],
            "static_predicted": st.get("static_memory_bytes"),
            "saved_measured": r.get("peak_activation_bytes"),
            "reserved_predicted": st.get("reserved_memory_bytes", 0),
            "ratio": r["peak_memory_bytes"] / r["predicted_memory_bytes"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "gpu_memory.json"))
    args = ap.parse_args()
    kept_ws = probe_workspace_bytes()
    print(f"cuBLAS workspaces (profiler.measure.library_workspace_bytes): {kept_ws} B")
    rows = []
    with tempfile.TemporaryDirectory() as t:
        for name, sizes in CONFIGS.items():
            for rc in ("0", "1"):
                try:
                    rows.append(row(name, sizes, rc, Path(t)))
                except RuntimeError as e:
                    rows.append({"model": name, "recompute": rc, "error": str(e)[-1500:]})
                print(json.dumps(rows[-1]), flush=True)
                Path(args.output).write_text(json.dumps(  # kept as it goes: a cut run keeps its rows
                    {"probe_kept_bytes": kept_ws, "rows": rows}, indent=1))
    print("| model | recompute | peak MB | predicted MB | peak − predicted MB | ratio | saved measured MB | static predicted MB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['recompute']} | error | | | | | |")
            continue
        mb = 1e6
        print(f"| {r['model']} | {r['recompute']} | {r['peak'] / mb:.1f} | {r['predicted'] / mb:.1f} | "
              f"{(r['peak'] - r['predicted']) / mb:.1f} | {r['ratio']:.3f} | "
              f"{(r['saved_measured'] or 0) / mb:.1f} | {(r['static_predicted'] or 0) / mb:.1f} |")


if __name__ == "__main__":
    main()
