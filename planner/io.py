"""Reading and writing the JSON file formats, with errors a user can act on."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import PipeplanError

M = TypeVar("M", bound=BaseModel)
_UMASK = os.umask(0)  # (read once: files are written with the permissions open() gives)
os.umask(_UMASK)


def describe_validation_error(exc: ValidationError) -> str:
    """One line per problem: `field.path: reason`."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {where}: {err['msg']}")
    return "\n".join(lines)


def parse_model(data: object, cls: type[M], what: str) -> M:
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise PipeplanError(f"{what} is not a valid {cls.__name__}:\n{describe_validation_error(exc)}") from None


def load_model(path: str | Path, cls: type[M], what: str | None = None) -> M:
    """Load a JSON file into `cls`; missing file, bad JSON and schema errors become PipeplanError."""
    path = Path(path)
    what = what or f"{path}"
    if not path.is_file():
        raise PipeplanError(f"{what}: no such file {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise PipeplanError(f"{what}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise PipeplanError(f"{what}: not UTF-8 text (byte {exc.start}); give the JSON file "
                            "pipeplan wrote, or save it as UTF-8") from None
    return parse_model(data, cls, what)


def check_output(path: str | Path | None, inputs: tuple[str | Path | None, ...] = (),
                 what: str = "-o") -> None:
    """Before any work: `path` can be written (not a directory, no regular file where a
    folder of it should be) and is none of `inputs` (a profile or model the command reads,
    which writing would destroy)."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise PipeplanError(f"{what} {path}: is a directory; give a file name")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PipeplanError(f"{what} {path}: {parent} is a file, not a directory")
            break
    for x in inputs:
        if x is not None and Path(x).exists() and os.path.realpath(x) == os.path.realpath(out):
            raise PipeplanError(f"{what} {path}: is the input {x}; writing it would destroy it: "
                                "give another file name")


def save_model(model: BaseModel, path: str | Path) -> None:
    """Write atomically (a temporary file of its own, then rename) so a crash never leaves half
    a file, and two writers of one path never share a temporary file."""
    write_text_atomic(path, model.model_dump_json(indent=2) + "\n")


def write_text_atomic(path: str | Path, text: str) -> None:
    path = Path(path)
    check_output(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

