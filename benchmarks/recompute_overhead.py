"""What does a recomputed stage's forward cost beyond the plain one? (issue 13)

A recomputed stage runs each of its blocks under torch.utils.checkpoint, and keeps the state
each block's forward found (`profiler.module_state`) so that the backward's recomputation runs
on it. The planner prices the stage's forward as the plain one: whatever the runtime adds per
block is not in the prediction. Per bundled example (small sizes, one thread), the stage of all
its layers: its forward plain (`StageModule`) and recomputed (`runtime.recompute.
recomputed_forward`), each the median of `--repeats` timed loops of `--calls` forwards,
alternated, with grad enabled as in training (no backward).

    PYTHONPATH=. .venv/bin/python benchmarks/recompute_overhead.py [--repeats 7] [--calls 100]

Prints a table; writes benchmarks/results/recompute_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "recompute_overhead.json"

import torch  # noqa: E402

from profiler.graph import build_stage, trace  # noqa: E402
from profiler.loader import load_model_file  # noqa: E402
from runtime.recompute import block_modules, recomputed_forward  # noqa: E402

EXAMPLES = {  # example -> environment for small sizes
    "mlp": {"PIPEPLAN_MLP_DIM": "64", "PIPEPLAN_MLP_BLOCKS": "4"},
    "gpt": {"PIPEPLAN_GPT_BLOCKS": "4", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "128",
            "PIPEPLAN_GPT_SEQ": "16"},
    "unet": {},
}


def _time(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def measure(name: str, repeats: int, calls: int, batch: int) -> dict:
    os.environ.update(EXAMPLES[name])
    mf = load_model_file(str(ROOT / "examples" / f"{name}.py"))
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, _ = mf.make_batch(batch)
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    lg = trace(model, inputs, granularity="blocks")
    layers = lg.layer_names()
    stage = build_stage(lg, layers)
    recomputed = recomputed_forward(stage, block_modules(lg, layers))
    feed = {k: inputs[int(k.split(":")[1])] for k in stage.input_keys}
    plain_ms, rec_ms = [], []
    for fn in (lambda: stage(feed), lambda: recomputed(feed)):
        _time(fn, max(calls // 5, 1))  # warm-up
    for _ in range(repeats):
        plain_ms.append(_time(lambda: stage(feed), calls))
        rec_ms.append(_time(lambda: recomputed(feed), calls))
    plain, rec = statistics.median(plain_ms), statistics.median(rec_ms)
    return {"example": name, "layers": len(layers), "plain_ms": plain, "recomputed_ms": rec,
            "extra_ms_per_layer": (rec - plain) / len(layers), "ratio": rec / plain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("-o", "--output", default=str(RESULTS))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [measure(name, args.repeats, args.calls, args.batch) for name in EXAMPLES]
    print(f"{'example':8s} {'layers':>6s} {'plain ms':>9s} {'recomputed ms':>14s} {'extra ms/layer':>15s} {'ratio':>6s}")
    for r in rows:
        print(f"{r['example']:8s} {r['layers']:6d} {r['plain_ms']:9.3f} {r['recomputed_ms']:14.3f} "
              f"{r['extra_ms_per_layer']:15.3f} {r['ratio']:6.2f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
