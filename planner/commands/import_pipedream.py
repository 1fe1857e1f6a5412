"""`python -m planner import-pipedream graph.txt --batch-size N -o profile.json`."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("import-pipedream", help="convert a PipeDream graph.txt profile",
                       description="Turn a PipeDream per-layer profile (graph.txt) into a pipeplan "
                       "profile.json, DAG included; activation bytes are estimated by output sizes.")
    p.add_argument("graph", help="PipeDream graph.txt")
    p.add_argument("--batch-size", type=int, required=True,
                   help="the minibatch size the profile was measured at (e.g. 128 for vgg16)")
    p.add_argument("-o", "--output", default="profile.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from planner.errors import PipeplanError
    from planner.importers.pipedream import import_pipedream_file
    from planner.io import check_numbers, check_output, save_model

    if args.batch_size <= 0:
        raise PipeplanError("--batch-size must be a positive integer")
    check_output(args.output, (args.graph,))
    profile = import_pipedream_file(args.graph, args.batch_size)
    check_numbers(profile.model_dump(), args.graph)
    save_model(profile, args.output)
    total = sum(x.fwd_ms + x.bwd_ms for x in profile.layers)
    print(f"wrote {args.output}: {len(profile.layers)} layers, {len(profile.edges)} edges, "
          f"{total:.1f} ms fwd+bwd per batch of {profile.batch_size}, "
          f"{sum(x.param_bytes for x in profile.layers) / 1e6:.1f} MB of parameters")
    return 0
