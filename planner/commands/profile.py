"""`python -m planner profile model.py --batch-size 8 -o profile.json`: measure every layer.

torch and the profiler are imported inside `run`, so the planner stays importable without torch.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from planner.errors import PipeplanError
from planner.limits import seed_arg


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="measure a model layer by layer (needs torch)",
        description="Load model.py (build_model, make_batch, loss_fn), trace it into layers, "
        "measure each layer's forward/backward time, parameter, activation and output bytes on "
        "one device, time the whole model, and write profile.json.",
    )
    p.add_argument("model", help="model file defining build_model(), make_batch(n), loss_fn(out, y)")
    p.add_argument("--batch-size", type=int, default=8, help="samples per profiled batch (8)")
    p.add_argument("-o", "--output", default="profile.json", help="where to write the profile")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer first (2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer; the median is kept (5)")
    p.add_argument("--granularity", default="blocks",
                   help="blocks (natural blocks, default) | modules (every leaf module) | "
                   "depth:N (module paths cut to N components)")
    p.add_argument("--split-points", metavar="A,B,...",
                   help="module names where layers start, e.g. model.layers.4,model.layers.8 (as "
                   "torchtitan's pipeline_parallel_split_points): the blocks are grouped into "
                   "one layer per run between split points (recorded as granularity split:A,B)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="CPU timing: wall (perf_counter, default) or thread (this thread's CPU "
                   "time: robust on a busy machine; needs --threads 1)")
    p.add_argument("--layer-timing", choices=["in-whole", "isolated"], default="in-whole",
                   help="in-whole (default): time every layer inside whole forward/backward passes, "
                   "so per-call costs land on the layers that cause them; isolated: run each "
                   "layer alone as its own stage")
    p.add_argument("--keep-call-overhead", action="store_true",
                   help="with --layer-timing isolated: do not subtract the fixed cost of calling a "
                   "stage from each layer's times")
    p.add_argument("--seed", type=seed_arg, default=0, help="torch seed for build_model and make_batch")
    p.add_argument("--tp", metavar="T,T,...",
                   help="also measure every layer as it runs on one of T tensor-parallel devices "
                   "(shard-sized modules from the model file's tp_plan(model), or a transformers "
                   "model's own plan), and the bytes of its TP all-reduces, e.g. --tp 2,4")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar and no table")
    p.set_defaults(func=run)


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f}"


def format_profile(profile: Any) -> str:
    """The table printed after profiling: per layer, totals, and the sum-vs-whole ratio."""
    rows = [("layer", "kind", "fwd ms", "bwd ms", "params MB", "activ MB", "out MB")]
    for layer in profile.layers:
        rows.append((layer.name, layer.kind or "", f"{layer.fwd_ms:.3f}", f"{layer.bwd_ms:.3f}",
                     _mb(layer.param_bytes), _mb(layer.activation_bytes), _mb(layer.output_bytes)))
    fwd = sum(x.fwd_ms for x in profile.layers)
    bwd = sum(x.bwd_ms for x in profile.layers)
    rows.append(("total (sum of layers)", "", f"{fwd:.3f}", f"{bwd:.3f}",
                 _mb(sum(x.param_bytes for x in profile.layers)),
                 _mb(sum(x.activation_bytes for x in profile.layers)), ""))
    m = profile.measured
    if m is not None:
        rows.append(("whole model", "", f"{m.fwd_ms:.3f}", f"{m.bwd_ms:.3f}", "",
                     _mb(getattr(m, "activation_bytes", 0) or 0), ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[1] = min(widths[1], 24)
    lines = []
    for i, r in enumerate(rows):
        cells = [r[0].ljust(widths[0]), r[1][:24].ljust(widths[1])]
        cells += [c.rjust(w) for c, w in zip(r[2:], widths[2:], strict=True)]
        lines.append("  ".join(cells).rstrip())
        if i == 0 or i == len(profile.layers):
            lines.append("-" * len(lines[0]))
    head = (f"{profile.model.path}  batch {profile.batch_size}  {profile.dtype}  on "
            f"{profile.device.type} ({profile.device.name})  {len(profile.layers)} layers")
    out = [head, *lines]
    if m is not None and (m.fwd_ms + m.bwd_ms) > 0:
        ratio = (fwd + bwd) / (m.fwd_ms + m.bwd_ms)
        out.append(f"per-layer sum / whole model (fwd+bwd): {ratio:.3f}")
        if abs(ratio - 1) > 0.25 and profile.device.type == "cpu" and getattr(profile, "clock", "") == "wall":
            out.append("note: the layer times do not add up to the whole model; on a busy CPU "
                       "profile with --threads 1 --clock thread (CPU time, unaffected by other "
                       "processes) and more --repeats")
    if m is not None and m.peak_memory_bytes:
        out.append(f"whole-model peak memory: {_mb(m.peak_memory_bytes)} MB")
    steps = [getattr(x, "optimizer_ms", None) or {} for x in profile.layers]
    if any(steps):
        names = [k for k in ("sgd", "momentum", "adam") if any(k in d for d in steps)]
        out.append("optimizer step per iteration (sum of layers): " + ", ".join(
            f"{k} {sum(d.get(k, 0.0) for d in steps):.3f} ms" for k in names))
    out.extend(format_tp(profile))
    return "\n".join(out)


def profile_warnings(profile: Any) -> list[str]:
    """What the user must see even with -q (printed to stderr): a model that waits profiled
    with --clock thread, whose figures then leave the waits out."""
    m = profile.measured
    wall = getattr(m, "wall_ms", None) if m is not None else None
    cpu = (m.fwd_ms + m.bwd_ms + (m.loss_ms or 0.0)) if m is not None else 0.0
    # four times: other processes on a busy machine (why --clock thread) stretch the wall clock
    # too, but rarely to a quarter of a core
    if wall is not None and wall > 4 * cpu + 1.0:
        return [f"warning: a whole pass took {wall:.3g} ms on the wall clock but {cpu:.3g} ms of "
                "this thread's CPU time: the model waits (sleeps, I/O, a device) or works in "
                "other threads, which --clock thread leaves out of every figure; profile with "
                "--clock wall"]
    return []


def format_tp(profile: Any) -> list[str]:
    """Per profiled TP degree: each layer on one of t devices (profile --tp)."""
    degrees = sorted({x.degree for layer in profile.layers for x in getattr(layer, "tp", None) or []})
    out: list[str] = []
    for t in degrees:
        rows = [("layer", "fwd ms", "bwd ms", "params MB", "activ MB", "TP AR fwd MB", "TP AR bwd MB")]
        for layer in profile.layers:
            x = layer.at_degree(t)
            if x is None:
                rows.append((layer.name, "-", "-", "-", "-", "-", "-"))
                continue
            rows.append((layer.name, f"{x.fwd_ms:.3f}", f"{x.bwd_ms:.3f}", _mb(x.param_bytes),
                         _mb(x.activation_bytes), _mb(x.allreduce_bytes_fwd), _mb(x.allreduce_bytes_bwd)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        out.append("")
        out.append(f"tensor parallel: one of {t} devices (per profiled batch; TP AR = all-reduce bytes)")
        for i, r in enumerate(rows):
            out.append("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                             zip(r[1:], widths[1:], strict=True)]).rstrip())
            if i == 0:
                out.append("-" * len(out[-1]))
    return out


def run(args: argparse.Namespace) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise PipeplanError("profiling needs torch: pip install torch") from None
    from tqdm import tqdm

    from planner.io import check_output, save_model
    from profiler.profile import profile_model_file

    check_output(args.output, (args.model,))
    degrees: list[int] = []
    if args.tp:  # checked before the layers are measured, not after
        from profiler.profile import check_tp_plan

        try:
            degrees = sorted({int(x) for x in args.tp.split(",") if x.strip()})
        except ValueError:
            raise PipeplanError(f"--tp {args.tp!r}: give degrees separated by commas, e.g. 2,4") from None
        if not degrees or min(degrees) < 2:
            raise PipeplanError(f"--tp {args.tp!r}: degrees must be at least 2")
        check_tp_plan(args.model, args.batch_size, seed=args.seed)
    bar: list[Any] = []

    def on_traced(lg: Any) -> None:
        if not args.quiet:
            bar.append(tqdm(total=args.warmup + args.repeats, unit="round", file=sys.stderr,
                            leave=False, desc=f"measuring {len(lg.layers)} layers + whole model"))

    def on_round(done: int, total: int) -> None:
        if bar:
            bar[0].update(done - bar[0].n)

    granularity = args.granularity
    if args.keep_call_overhead and args.layer_timing != "isolated":  # (it was ignored silently)
        raise PipeplanError("--keep-call-overhead applies to --layer-timing isolated only (in-whole "
                            "timing has no per-call cost to subtract); give both, or leave it out")
    if args.split_points is not None:
        points = [x.strip() for x in args.split_points.split(",") if x.strip()]
        if not points or granularity != "blocks":
            raise PipeplanError("--split-points takes module names separated by commas, e.g. "
                                "--split-points layers.4,layers.8 (and no --granularity)")
        granularity = "split:" + ",".join(points)
    try:
        profile = profile_model_file(
            args.model, args.batch_size, device=args.device, warmup=args.warmup,
            repeats=args.repeats, granularity=granularity, on_round=on_round,
            on_traced=on_traced, seed=args.seed, threads=args.threads,
            clock=args.clock, subtract_overhead=not args.keep_call_overhead,
            layer_timing=args.layer_timing,
        )
    finally:
        if bar:
            bar[0].close()
    if degrees:
        from profiler.profile import add_tp_degrees

        profile = add_tp_degrees(profile, args.model, degrees, args.batch_size, seed=args.seed,
                                 warmup=args.warmup, repeats=args.repeats, clock=args.clock)
    save_model(profile, args.output)
    for line in profile_warnings(profile):  # (with -q too: it was part of the table)
        print(line, file=sys.stderr)
    if not args.quiet:
        print(format_profile(profile))
        print(f"wrote {args.output}")
    return 0
