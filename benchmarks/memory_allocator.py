"""Is a stage's predicted memory what the allocator really holds during a training step?

For each model, a one-stage plan (`--method manual`, SGD, one microbatch of the profiled batch)
predicts the memory beyond parameters and gradients: the activations the forward saves, the
loss's saved tensors and, during the backward, the loss's working memory
(`measured.loss_workspace_bytes`). The reference is independent of the planner and of the
saved-tensor hooks the profiler counts with: the CPU allocator's peak over a plain training
step of the same model (`model(x)`, the loss, `backward()`, with the gradients allocated
beforehand and the model's output dropped once the loss has it, as the runtime's last stage
does), from torch.profiler's allocation events (`profiler.allocations.peak_new_bytes`).
"without loss ws" is the prediction as it was before the loss's working memory was modelled.

    PYTHONPATH=. .venv/bin/python benchmarks/memory_allocator.py       # ~1 min on 2 cores

Prints a table and writes benchmarks/results/memory_allocator.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "memory_allocator.json"

GPT = {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "64", "PIPEPLAN_GPT_SEQ": "64"}
MODELS = {  # name: (file, environment, batch)
    "gpt vocab 2048": ("gpt.py", {**GPT, "PIPEPLAN_GPT_VOCAB": "2048"}, 4),
    "gpt vocab 32000": ("gpt.py", {**GPT, "PIPEPLAN_GPT_VOCAB": "32000"}, 4),
    "mlp": ("mlp.py", {}, 32),
    "unet": ("unet.py", {}, 4),
    "small_layers": ("small_layers.py", {}, 32),
}


def row(name: str, file: str, env: dict[str, str], batch: int) -> dict[str, object]:
    import torch

    from planner.formats import Cluster, PlanOptions
    from planner.solve import make_plan
    from profiler.allocations import peak_new_bytes
    from profiler.loader import batch_checked, build_checked, load_model_file
    from profiler.profile import profile_model_file

    with mock.patch.dict(os.environ, env):
        path = ROOT / "examples" / file
        profile = profile_model_file(path, batch_size=batch, warmup=0, repeats=1)
        cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": 1, "device_memory_gb": 64,
                                          "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
        plan = make_plan(profile, cluster, PlanOptions(
            global_batch=batch, microbatch_size=batch, method="manual", split=[len(profile.layers)],
            replicas=[1], optimizer="sgd"))
        p = plan.stages[0].predicted
        predicted = p.memory_bytes - p.static_memory_bytes
        ws = profile.measured.loss_workspace_bytes or 0
        mf = load_model_file(path)
        torch.manual_seed(0)
        model = build_checked(mf, batch)
        inputs, target = batch_checked(mf, batch)
        inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        for q in model.parameters():
            q.grad = torch.zeros_like(q)

        def step() -> None:
            out = model(*inputs)
            loss = mf.loss_fn(out, target)
            del out
            loss.backward()

        step()  # warm: lazily built buffers
        real, _ = peak_new_bytes(step, torch.device("cpu"))
    return {"model": name, "batch": batch, "saved_bytes": profile.measured.activation_bytes,
            "loss_saved_bytes": profile.measured.loss_activation_bytes or 0,
            "loss_workspace_bytes": ws, "predicted_bytes": predicted, "allocator_peak_bytes": real,
            "ratio": real / predicted, "ratio_without_loss_ws": real / max(predicted - ws, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("-o", "--output", default=str(RESULTS))
    args = ap.parse_args()
    names = args.only.split(",") if args.only else list(MODELS)
    rows = [row(n, *MODELS[n]) for n in names]
    print(f"{'model':18s} {'saved MB':>9s} {'loss ws MB':>10s} {'predicted MB':>12s} "
          f"{'allocator MB':>12s} {'real/pred':>9s} {'without ws':>10s}")
    for r in rows:
        print(f"{r['model']:18s} {r['saved_bytes'] / 1e6:9.3f} {r['loss_workspace_bytes'] / 1e6:10.3f} "
              f"{r['predicted_bytes'] / 1e6:12.3f} {r['allocator_peak_bytes'] / 1e6:12.3f} "
              f"{r['ratio']:9.3f} {r['ratio_without_loss_ws']:10.3f}")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps({"rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
