"""Peak memory per rank, measured by the runtime against the plan's prediction, for ZB-H1 and
1F1B on the same split, with and without recomputation (issue 13).

For each model (examples/gpt.py, examples/mlp.py and the DAG examples/unet.py, at small
sizes), number of stages and recompute vector, profiles the model once, makes a manual plan
(`method=manual`, an even split) per schedule, runs it with the runtime (gloo, local launcher,
`--report`) and compares each rank's `peak_memory_bytes` with its stage's
`predicted.memory_bytes`.

    python benchmarks/memory.py [--steps 2] [--stages 2,4]
    python benchmarks/memory.py --from-json benchmarks/results/memory.json [--markdown]

Prints a table per rank and one comparing ZB-H1's peak over the ranks with 1F1B's on the same
split, and writes benchmarks/results/memory.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "gpt": ("gpt.py", {"PIPEPLAN_GPT_BLOCKS": "4", "PIPEPLAN_GPT_DIM": "64", "PIPEPLAN_GPT_VOCAB": "512",
                       "PIPEPLAN_GPT_SEQ": "32"}),
    "mlp": ("mlp.py", {"PIPEPLAN_MLP_BLOCKS": "4", "PIPEPLAN_MLP_DIM": "64"}),
    "unet": ("unet.py", {"PIPEPLAN_UNET_DEPTH": "2", "PIPEPLAN_UNET_CH": "8", "PIPEPLAN_UNET_SIZE": "16"}),
}


def recompute_cases(stages: int) -> list[tuple[int, ...]]:
    """No recomputation, the first stage only, the last only, every stage."""
    cases = [(0,) * stages, (1,) + (0,) * (stages - 1), (0,) * (stages - 1) + (1,), (1,) * stages]
    return list(dict.fromkeys(cases))


def even_split(n: int, stages: int) -> list[int]:
    return [n // stages + (1 if i < n % stages else 0) for i in range(stages)]


def measure(model: str, stages: int, schedule: str, recompute: tuple[int, ...], *, steps: int,
            global_batch: int, microbatch_size: int, optimizer: str, profile: object,
            tmp: Path) -> list[dict]:
    """Plan (manual) and run once; one row per rank."""
    from planner.formats import Cluster, PlanOptions
    from planner.io import save_model
    from planner.solve import make_plan
    from runtime.cli import main as runtime_main

    cluster = Cluster.model_validate({"nodes": 1, "devices_per_node": stages, "device_memory_gb": 1,
                                      "intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1})
    n = len(profile.layers)  # type: ignore[attr-defined]
    options = PlanOptions(global_batch=global_batch, microbatch_size=microbatch_size, method="manual",
                          split=even_split(n, stages), replicas=[1] * stages, schedule=schedule,  # type: ignore[arg-type]
                          recompute=[bool(x) for x in recompute], optimizer=optimizer)  # type: ignore[arg-type]
    plan = make_plan(profile, cluster, options)  # type: ignore[arg-type]
    path = tmp / "plan.json"
    save_model(plan, path)
    report_path = tmp / "report.json"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = runtime_main([str(path), "--model", str(ROOT / "examples" / MODELS[model][0]), "--steps",
                           str(steps), "--optimizer", optimizer, "--report", str(report_path),
                           "--timeout", "120"])
    if rc != 0:
        raise SystemExit(f"{model} {stages} stages {schedule} recompute {recompute}: runtime failed")
    report = json.loads(report_path.read_text())
    rows = []
    for r in sorted(report["ranks"], key=lambda r: r["rank"]):
        st = plan.stages[r["stage"]]
        predicted = st.predicted.memory_bytes
        rows.append({
            "model": model, "stages": stages, "schedule": schedule,
            "recompute": ",".join(str(x) for x in recompute), "rank": r["rank"],
            "layers": len(st.layers), "predicted_bytes": predicted,
            "measured_bytes": r["peak_memory_bytes"],
            "error": r["peak_memory_bytes"] / predicted - 1,
            "peak_inflight": r["peak_inflight_microbatches"],
            "deferred_w": plan.generator.params.get("deferred_w") if plan.generator else None,
            "fused_backward": plan.generator.params.get("fused_backward") if plan.generator else None,
            "peak_activation_bytes": r.get("peak_activation_bytes"),
        })
    return rows


def print_markdown(rows: list[dict]) -> None:
    """The per-rank table as benchmarks/README.md shows it."""
    print("| model | stages | schedule | recompute | rank | predicted B | measured B | error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['stages']} | {r['schedule']} | {r['recompute']} | {r['rank']} | "
              f"{r['predicted_bytes']:,} | {r['measured_bytes']:,} | {100 * r['error']:+.2f} % |")


def print_tables(rows: list[dict]) -> None:
    print("model stages schedule recompute rank  predicted B   measured B   error")
    for r in rows:
        print(f"{r['model']:5} {r['stages']:6} {r['schedule']:8} {r['recompute']:9} {r['rank']:4} "
              f"{r['predicted_bytes']:>12,} {r['measured_bytes']:>12,} {100 * r['error']:+6.2f} %")
    worst = max(abs(r["error"]) for r in rows)
    print(f"\nworst |error| {100 * worst:.2f} % over {len(rows)} ranks\n")
    print("peak over the ranks (measured)\nmodel stages recompute   1F1B B       ZB-H1 B      ZB/1F1B")
    keys = sorted({(r["model"], r["stages"], r["recompute"]) for r in rows})
    for model, stages, rec in keys:
        peak = {sched: max((r["measured_bytes"] for r in rows if (r["model"], r["stages"], r["recompute"],
                                                                   r["schedule"]) == (model, stages, rec, sched)),
                           default=0) for sched in ("1f1b", "zb-h1")}
        if peak["1f1b"] and peak["zb-h1"]:
            print(f"{model:5} {stages:6} {rec:9} {peak['1f1b']:>12,} {peak['zb-h1']:>12,} "
                  f"{peak['zb-h1'] / peak['1f1b']:8.3f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--stages", default="2,4")
    ap.add_argument("--models", default="gpt,mlp,unet")
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--microbatch-size", type=int, default=2)
    ap.add_argument("--optimizer", default="adam")
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "memory.json"))
    ap.add_argument("--from-json", help="print the tables of an earlier run's JSON and stop")
    ap.add_argument("--markdown", action="store_true", help="with --from-json: the README's table")
    args = ap.parse_args(argv)
    if args.from_json:
        rows = json.loads(Path(args.from_json).read_text())["rows"]
        (print_markdown if args.markdown else print_tables)(rows)
        return 0
    from profiler.profile import profile_model_file

    rows: list[dict] = []
    for model in args.models.split(","):
        file, env = MODELS[model]
        os.environ.update(env)
        profile = profile_model_file(ROOT / "examples" / file, batch_size=args.microbatch_size,
                                     warmup=0, repeats=1)
        for stages in (int(x) for x in args.stages.split(",")):
            for recompute in recompute_cases(stages):
                for schedule in ("1f1b", "zb-h1"):
                    with tempfile.TemporaryDirectory() as d:
                        got = measure(model, stages, schedule, recompute, steps=args.steps,
                                      global_batch=args.global_batch,
                                      microbatch_size=args.microbatch_size,
                                      optimizer=args.optimizer, profile=profile, tmp=Path(d))
                    rows += got
    print_tables(rows)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "models": {k: v[1] for k, v in MODELS.items()},
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
