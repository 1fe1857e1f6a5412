"""`python -m planner` / `pipeplan`: one sub-command per module in `planner.commands`.

Each command module exposes `register(subparsers) -> None`, which adds its parser and sets
`func` (a callable taking the parsed namespace and returning an exit status). Commands that need
torch (profile) import it inside their function, so `import planner.cli` stays torch-free.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from planner.errors import OneLineParser, PipeplanError

COMMANDS = ["profile", "import_pipedream", "plan", "simulate", "refine", "serve"]


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="pipeplan",
        description="Profile a PyTorch model, plan its pipeline-parallel training, run the plan.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        module_name = f"planner.commands.{name}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:  # a command not built yet
            if exc.name == module_name:
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return int(args.func(args) or 0)
    except PipeplanError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        where = _user_frame(exc)
        print("interrupted" + (f" while running {where} (your code: is it waiting or looping "
                               "there?)" if where else ""), file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: not an error of ours
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


def _user_frame(exc: BaseException) -> str | None:
    """`file:line (function)` of the innermost frame of `exc`'s traceback in a file outside
    pipeplan, Python and its installed packages (a model file that hangs at import or in
    build_model): what a user stopping a command that seems stuck needs to know."""
    import os
    import sysconfig
    import traceback

    own = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    packages = {os.path.abspath(p) for p in sysconfig.get_paths().values()}
    found = None
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or any(path.startswith(p + os.sep) for p in packages):
            continue
        if path.startswith(own + os.sep) and not path.startswith(os.path.join(own, "examples") + os.sep):
            continue
        found = f"{frame.filename}:{frame.lineno} ({frame.name})"
    return found
