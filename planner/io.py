"""Reading and writing the JSON file formats, with errors a user can act on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import PipeplanError

M = TypeVar("M", bound=BaseModel)


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
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PipeplanError(f"{what}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    return parse_model(data, cls, what)


def save_model(model: BaseModel, path: str | Path) -> None:
    """Write atomically (temporary file, then rename) so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(model.model_dump_json(indent=2) + "\n")
    tmp.replace(path)
