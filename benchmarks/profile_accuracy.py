"""Does the per-layer profile add up? For each example model: the sum over layers of forward +
backward time against the whole model timed in one piece (target: within 10% on CPU), and
the profiler's own wall time.

    python benchmarks/profile_accuracy.py [--device cpu|cuda] [--batch-size 8] [--repeats 20]
                                          [--threads N] [--clock wall|thread] [--small-only]
                                          [--layer-timing in-whole|isolated] [--models a,b]

Writes benchmarks/results/profile_accuracy[_cuda].json. Sizes: each example's defaults, plus
the `large` preset (environment variables below) unless --small-only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS: dict[str, dict[str, dict[str, str]]] = {
    "default": {
        "mlp": {}, "gpt": {}, "unet": {},
        # 48 layers of ~45 µs (linear 32x32 + GELU + add) and of ~20 µs (scale + tanh), batch 8
        "small_layers": {}, "small_layers@scale": {"PIPEPLAN_SMALL_KIND": "scale"},
        # layers that sleep 5 ms forward, 10 ms backward (a custom autograd Function)
        "sleep": {"PIPEPLAN_SLEEP_MS": "5"},
    },
    "large": {
        "mlp": {"PIPEPLAN_MLP_BLOCKS": "8", "PIPEPLAN_MLP_DIM": "1024"},
        "gpt": {"PIPEPLAN_GPT_BLOCKS": "6", "PIPEPLAN_GPT_DIM": "256", "PIPEPLAN_GPT_SEQ": "128",
                "PIPEPLAN_GPT_VOCAB": "8192", "PIPEPLAN_GPT_HEADS": "8"},
        "unet": {"PIPEPLAN_UNET_CH": "32", "PIPEPLAN_UNET_SIZE": "64"},
    },
}


def run_one(model: str, env: dict[str, str], args: argparse.Namespace) -> dict:
    from profiler.profile import profile_model_file

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        t0 = time.perf_counter()
        p = profile_model_file(ROOT / "examples" / f"{model.split('@')[0]}.py", args.batch_size,
                               device=args.device, warmup=args.warmup, repeats=args.repeats,
                               threads=args.threads, clock=args.clock,
                               layer_timing=args.layer_timing)
        wall = time.perf_counter() - t0
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    fwd = sum(x.fwd_ms for x in p.layers)
    bwd = sum(x.bwd_ms for x in p.layers)
    assert p.measured is not None
    whole = p.measured.fwd_ms + p.measured.bwd_ms
    return {
        "model": model, "layers": len(p.layers), "layer_timing": args.layer_timing,
        "us_per_layer": (fwd + bwd) / len(p.layers) * 1e3,
        "param_mb": sum(x.param_bytes for x in p.layers) / 1e6,
        "layer_fwd_ms": fwd, "layer_bwd_ms": bwd,
        "whole_fwd_ms": p.measured.fwd_ms, "whole_bwd_ms": p.measured.bwd_ms,
        "ratio_fwd": fwd / p.measured.fwd_ms, "ratio_bwd": bwd / p.measured.bwd_ms,
        "ratio": (fwd + bwd) / whole, "within_10pct": abs((fwd + bwd) / whole - 1) <= 0.10,
        "profiler_wall_s": wall, "device": p.device.name,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall")
    ap.add_argument("--small-only", action="store_true")
    ap.add_argument("--layer-timing", choices=["in-whole", "isolated"], default="in-whole")
    ap.add_argument("--models", help="only these models (comma-separated preset keys)")
    ap.add_argument("-o", "--output")
    args = ap.parse_args()
    import torch

    presets = ["default"] if args.small_only else ["default", "large"]
    rows = []
    for preset in presets:
        for model, env in PRESETS[preset].items():
            if args.models and model not in args.models.split(","):
                continue
            row = run_one(model, env, args)
            row["preset"] = preset
            rows.append(row)
            print(f"  {preset}/{model}: ratio {row['ratio']:.3f}", file=sys.stderr)
    header = ("preset", "model", "layers", "µs/layer", "params MB", "sum fwd+bwd ms",
              "whole fwd+bwd ms", "ratio fwd", "ratio bwd", "ratio", "profiler s")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['model']} | {r['layers']} | {r['us_per_layer']:.0f} | {r['param_mb']:.1f} | "
            f"{r['layer_fwd_ms'] + r['layer_bwd_ms']:.2f} | {r['whole_fwd_ms'] + r['whole_bwd_ms']:.2f} | "
            f"{r['ratio_fwd']:.3f} | {r['ratio_bwd']:.3f} | {r['ratio']:.3f} | {r['profiler_wall_s']:.1f} |"
        )
    print("\n".join(lines))
    out = Path(args.output) if args.output else ROOT / "benchmarks" / "results" / (
        "profile_accuracy.json" if args.device == "cpu" else "profile_accuracy_cuda.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": " ".join(["python", *sys.argv]), "device": args.device,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "host": platform.node(),
        "clock": args.clock, "layer_timing": args.layer_timing, "batch_size": args.batch_size,
        "warmup": args.warmup, "repeats": args.repeats, "rows": rows,
    }, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    from planner.errors import PipeplanError

    try:
        main()
    except PipeplanError as exc:  # e.g. --device cuda without a GPU: one line, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
