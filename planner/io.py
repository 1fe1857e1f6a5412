"""Reading and writing the JSON file formats, with errors a user can act on."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from planner.errors import PipeplanError
from planner.limits import field_path, out_of_range, small_divisor

M = TypeVar("M", bound=BaseModel)
_UMASK = os.umask(0)  # (read once: files are written with the permissions open() gives)
os.umask(_UMASK)


def _is_tag(part: object) -> bool:
    """A union branch in an error's location (`constrained-int`, `list[NodeSpec]`), not a field."""
    return isinstance(part, str) and not part.isidentifier()


def describe_validation_error(exc: ValidationError, most: int = 12) -> str:
    """One line per problem: `field.path: reason`. Where a field may take several forms (a
    union), only the forms the value was meant to take are described: those with a fault
    other than their type, else those whose fault lies deepest (a list whose element is
    wrong, not "should be an integer"); branch names are not printed; unknown fields of one
    object are one line."""
    errs = exc.errors()
    branches: dict[tuple, dict[object, tuple[bool, int]]] = {}  # prefix -> branch -> (real fault, depth)
    for err in errs:
        loc = err["loc"]
        for k, part in enumerate(loc):
            if _is_tag(part):
                real, depth = branches.setdefault(tuple(loc[:k]), {}).get(part, (False, 0))
                branches[tuple(loc[:k])][part] = (real or not err["type"].endswith(("_type", "_parsing")),
                                                  max(depth, len(loc)))
    keep: dict[tuple, set[object]] = {}
    for prefix, got in branches.items():
        real = {b for b, (r, _) in got.items() if r}
        deepest = max(d for _, d in got.values())
        keep[prefix] = real or {b for b, (_, d) in got.items() if d == deepest}
    lines: list[str] = []
    extra: dict[str, list[str]] = {}
    for err in errs:
        loc = err["loc"]
        if any(_is_tag(part) and part not in keep.get(tuple(loc[:k]), {part}) for k, part in enumerate(loc)):
            continue  # a form the value was not meant to take
        path = [str(p) for p in loc if not _is_tag(p)]
        if err["type"] == "extra_forbidden" and path:
            extra.setdefault(".".join(path[:-1]) or "(top level)", []).append(path[-1])
            continue
        msg = err["msg"].removeprefix("Value error, ")  # pydantic's prefix of a validator's message
        lines.append(f"  {'.'.join(path) or '(top level)'}: {msg}")
    for where, names in extra.items():
        lines.append(f"  {where}: unknown field(s) {', '.join(names)}")
    lines = list(dict.fromkeys(lines))
    if len(lines) > most:
        lines = [*lines[:most], f"  ... and {len(lines) - most} more"]
    return "\n".join(lines)


def parse_model(data: object, cls: type[M], what: str, strict: bool = False) -> M:
    """`data` as `cls`, else a PipeplanError listing what is wrong. `strict`: read as JSON is read
    strictly (the service's rule): `true` or `"4"` is not a number, `1.5` is not an integer."""
    try:
        if strict:
            return cls.model_validate_json(json.dumps(data), strict=True)
        return cls.model_validate(data)
    except ValidationError as exc:
        raise PipeplanError(f"{what} is not a valid {cls.__name__}:{one_or_more_lines(describe_validation_error(exc))}") from None


def one_or_more_lines(described: str) -> str:
    """A description after a colon: on the same line if it is one problem, else below it."""
    return " " + described.strip() if "\n" not in described else "\n" + described


def cannot_read(path: str | Path, exc: OSError) -> str:
    """What to tell the user of an input that exists but cannot be read (permissions)."""
    return (f"{path} cannot be read ({exc.strerror or exc}); check its permissions and its "
            "folders' (the user running pipeplan must be able to read it), or give another file")


def is_readable_file(path: str | Path, what: str | None = None) -> bool:
    """Whether `path` is a regular file; a PipeplanError where it cannot even be looked at (a
    folder on its way without search permission: `Path.is_file` raises PermissionError)."""
    try:
        return Path(path).is_file()
    except OSError as exc:
        raise PipeplanError(f"{what}: {cannot_read(path, exc)}" if what else cannot_read(path, exc)) from None


def not_a_file(path: str | Path) -> str:
    """Why `path` cannot be read as a file (it is not a regular file): what to tell the user."""
    path = Path(path)
    if path.is_dir():
        return f"{path} is a directory, not a file"
    if path.exists():
        return f"{path} is not a regular file (a device, pipe or socket)"
    return f"no such file {path}"


class DuplicateKeyError(ValueError):
    """A JSON object that names one key twice: `json` keeps the last silently."""

    def __init__(self, key: str) -> None:
        super().__init__(f"the key {key!r} appears twice in one object")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for `json.loads`: a dict, or DuplicateKeyError on a repeated key."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "must not contain the NUL character (\\u0000)"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "must be valid Unicode (a lone surrogate such as \\ud800 is not)"
    return None


def bad_strings(doc: Any, root: tuple[str | int, ...] = (), max_depth: int = 10_000
                ) -> tuple[tuple[str | int, ...], str] | None:
    """The first place (in document order) where `doc` nests deeper than `max_depth` or a
    string (or key) holds a NUL character or a lone surrogate, with the reason; None if none.
    Iterative, so any depth is safe to check, and it keeps only the path it is on: a path per
    value made a body of 4 million numbers cost 16 s and 660 MB before its layers were counted
    (an outside review; 0.5 s and no more memory now)."""
    if isinstance(doc, str):
        bad = _bad_text(doc)
        return (root, f"strings {bad}") if bad else None
    if not isinstance(doc, dict | list):
        return None
    if len(root) > max_depth:
        return root, f"JSON nested deeper than {max_depth} levels"
    path: list[str | int] = []  # the keys from `doc` down to the container iterated last
    stack: list[Any] = [_items(doc)]
    while stack:
        for k, v in stack[-1]:
            if isinstance(k, str) and (bad := _bad_text(k)):
                return (*root, *path), f"keys {bad}"
            if isinstance(v, str):
                if bad := _bad_text(v):
                    return (*root, *path, k), f"strings {bad}"
            elif isinstance(v, dict | list):
                path.append(k)
                if len(root) + len(path) > max_depth:
                    return (*root, *path), f"JSON nested deeper than {max_depth} levels"
                stack.append(_items(v))
                break
        else:
            stack.pop()
            if path:
                path.pop()
    return None


def _items(obj: dict | list) -> Any:
    return iter(obj.items()) if isinstance(obj, dict) else enumerate(obj)


def load_model(path: str | Path, cls: type[M], what: str | None = None) -> M:
    """Load a JSON file into `cls`; missing file, bad JSON and schema errors become PipeplanError."""
    path = Path(path)
    what = what or f"{path}"
    if not is_readable_file(path, what):
        raise PipeplanError(f"{what}: {not_a_file(path)}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark ignored
    except UnicodeDecodeError as exc:
        raise PipeplanError(f"{what}: not UTF-8 text (byte {exc.start}); give the JSON file "
                            "pipeplan wrote, or save it as UTF-8") from None
    except OSError as exc:  # no read permission (an unreadable input was a traceback)
        raise PipeplanError(f"{what}: {cannot_read(path, exc)}") from None
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as exc:
        raise PipeplanError(f"{what}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    except UnicodeDecodeError as exc:
        raise PipeplanError(f"{what}: not UTF-8 text (byte {exc.start}); give the JSON file "
                            "pipeplan wrote, or save it as UTF-8") from None
    except DuplicateKeyError as exc:
        raise PipeplanError(f"{what}: {exc}; JSON keeps only the last, so say each once") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise PipeplanError(f"{what}: holds a number of thousands of digits, more than any field "
                            "takes; give the JSON file pipeplan wrote") from None
    except RecursionError:
        raise PipeplanError(f"{what}: JSON nested too deeply to read; give the JSON file pipeplan "
                            "wrote") from None
    kind = file_kind(data)
    if kind is not None and kind != cls.__name__ and cls.__name__ in KINDS:
        name, file = KINDS[cls.__name__]
        raise PipeplanError(f"{what}: this file is a {KINDS[kind][0]}, not a {name}; give {file}")
    check_numbers(data, what)
    if cls.__name__ in ("Cluster", "Plan") and isinstance(data, dict):  # (a plan holds its cluster)
        small = small_divisor(data.get("cluster", data) if cls.__name__ == "Plan" else data)
        if small is not None:  # as the service refuses it in a body
            raise PipeplanError(f"{what}: {field_path(small[0])}: {small[1]}; correct that value")
    bad = bad_strings(data)
    if bad is not None:  # as the service refuses them in a body
        where = ".".join(map(str, bad[0])) or "the top level"
        raise PipeplanError(f"{what}: at {where}: {bad[1]}; give the JSON file pipeplan wrote")
    return parse_model(data, cls, what, strict=True)


# pipeplan's file formats, each told by fields only it has (a profile given where the plan goes
# listed six "Field required" lines instead of saying so)
KINDS = {"Profile": ("profile", "the profile.json `planner profile` wrote"),
         "Cluster": ("cluster description", "a cluster.json"),
         "Plan": ("plan", "the plan.json `planner plan` wrote"),
         "Report": ("run report", "the report.json `runtime run --report` wrote")}
_SIGNS = {"Profile": ("layers", "batch_size"), "Cluster": ("intra_node_gb_per_s", "inter_node_gb_per_s"),
          "Plan": ("stages", "profile_sha256"), "Report": ("ranks", "plan_profile_sha256")}


def file_kind(data: object) -> str | None:
    """Which of pipeplan's formats `data` is, by the fields only that format has; None if none."""
    if not isinstance(data, dict):
        return None
    kinds = [k for k, sign in _SIGNS.items() if all(f in data for f in sign)]
    return kinds[0] if len(kinds) == 1 else None


def check_numbers(data: object, what: str) -> None:
    """Every number of `data` (a JSON document) one pipeplan computes with (`planner.limits`),
    else a PipeplanError naming `what` and the field."""
    bad = out_of_range(data)
    if bad is not None:
        raise PipeplanError(f"{what}: {field_path(bad[0])}: {bad[1]}; correct that value")


def check_output(path: str | Path | None, inputs: tuple[str | Path | None, ...] = (),
                 what: str = "-o", probe: bool = True) -> None:
    """Before any work: `path` can be written (not a directory, not a device or pipe, no
    regular file where a folder of it should be, a folder that takes a file: with `probe`, a
    temporary file made and removed there) and is none of `inputs` (a profile or model the
    command reads, which writing would destroy). Without `probe` (a rank that will not write
    the file: only rank 0 writes the report, the trace, the checkpoint) the folder is not
    tried: on another node it may not exist or take files."""
    if path is None:
        return
    if str(path).strip() == "":
        raise PipeplanError(f"{what} '': an empty path; give a file name")
    if str(path).endswith(("/", os.sep)):  # Path() drops the slash: a file of the folder's name
        raise PipeplanError(f"{what} {path}: ends in '/', a directory; give a file name in it "
                            f"(e.g. {str(path).rstrip('/' + os.sep) or '.'}/plan.json)")
    try:
        _check_output(Path(path), path, inputs, what, probe)
    except OSError as exc:  # a folder on the way that cannot be searched (mode 000)
        raise PipeplanError(f"{what} {path}: cannot be checked ({exc.strerror or exc}); choose "
                            "another path") from None


def _check_output(out: Path, path: str | Path, inputs: tuple[str | Path | None, ...], what: str,
                  probe: bool) -> None:
    if out.is_dir():
        raise PipeplanError(f"{what} {path}: is a directory; give a file name")
    if out.exists() and not out.is_file():
        # a device, FIFO or socket: the atomic write would replace it with a regular file
        # (run as root, `-o /dev/null` replaced the system's /dev/null)
        raise PipeplanError(f"{what} {path}: is not a regular file (a device, pipe or socket); "
                            "give a file name")
    folder = next((p for p in out.parents if p.exists()), Path("."))
    if not folder.is_dir():
        raise PipeplanError(f"{what} {path}: {folder} is a file, not a directory")
    try:  # the folder the file (or its missing folders) will be made in takes a file
        if probe:
            fd, name = tempfile.mkstemp(dir=folder, prefix=".pipeplan-probe.", suffix=".tmp")
            os.close(fd)
            os.unlink(name)
    except OSError as exc:
        raise PipeplanError(f"{what} {path}: cannot write in {folder} ({exc.strerror or exc}); "
                            "choose another path") from None
    for x in inputs:  # (os.path.exists: an input that cannot be looked at is its own error)
        if x is not None and os.path.exists(x) and os.path.realpath(x) == os.path.realpath(out):
            raise PipeplanError(f"{what} {path}: is the input {x}; writing it would destroy it: "
                                "give another file name")


def check_distinct(outputs: list[tuple[str, str | Path | None]]) -> None:
    """Before any work: no two of a command's outputs (option, path) are one file (the one
    written last would replace the other)."""
    seen: dict[Path, str] = {}
    for what, path in outputs:
        if path is None:
            continue
        key = Path(os.path.realpath(path))
        if key in seen:
            raise PipeplanError(f"{seen[key]} and {what} are the same file ({path}): the one "
                                "written last would replace the other; give each its own file")
        seen[key] = what


def check_in_range(model: BaseModel, path: str | Path) -> None:
    """`model` holds no number pipeplan would refuse to read back (`load_model`)."""
    bad = out_of_range(model.model_dump())
    if bad is not None:
        raise PipeplanError(f"{path}: not written: {field_path(bad[0])}: {bad[1]} (the inputs' "
                            "numbers are too large to compute with; check them)")


def check_readable(model: BaseModel, path: str | Path, cause: str, exclude_none: bool = False) -> None:
    """`model` is one pipeplan reads back (`load_model`: every field within its bounds, not
    only the numbers' range), else a PipeplanError saying it was not written and `cause`."""
    check_in_range(model, path)
    try:
        type(model).model_validate_json(model.model_dump_json(exclude_none=exclude_none), strict=True)
    except ValidationError as exc:
        raise PipeplanError(f"{path}: not written, pipeplan would refuse to read it:\n"
                            f"{describe_validation_error(exc, most=4)}\n{cause}") from None


def save_model(model: BaseModel, path: str | Path) -> None:
    """Write atomically (a temporary file of its own, then rename) so a crash never leaves half
    a file, and two writers of one path never share a temporary file. A model holding a
    number pipeplan would refuse to read back (`load_model`) is not written."""
    check_in_range(model, path)
    write_text_atomic(path, model.model_dump_json(indent=2) + "\n")


def _temp_beside(path: Path, text: str, unchanged: str) -> str:
    """`text` in a new temporary file beside `path` (its folders made), its name returned; a
    PipeplanError that says what failed (`unchanged`: which files are as they were)."""
    check_output(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    except OSError as exc:
        raise PipeplanError(f"{path}: cannot write ({exc.strerror or exc}); choose another path") from None
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError as exc:  # the disk full, a quota, the folder gone meanwhile
        Path(tmp).unlink(missing_ok=True)
        raise PipeplanError(f"{path}: not written ({exc.strerror or exc}){unchanged}; free space or "
                            "choose another path, and run the command again") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return tmp


def write_texts_atomic(files: list[tuple[str | Path, str]]) -> None:
    """Several files, all or none: every one written to a temporary file beside it first, and
    only then all renamed into place. (`refine` renamed its four files in one after another: a
    disk that filled while the third was written left the new corrections and cluster beside
    the old plan and profile.)"""
    unchanged = "" if len(files) < 2 else f"; none of {', '.join(str(p) for p, _ in files)} was changed"
    temps: list[tuple[str, Path]] = []
    try:
        for path, text in files:
            temps.append((_temp_beside(Path(path), text, unchanged), Path(path)))
        for tmp, path in temps:
            try:
                os.replace(tmp, path)
            except OSError as exc:  # the folder gone meanwhile
                raise PipeplanError(f"{path}: not written ({exc.strerror or exc}); choose another "
                                    "path, and run the command again") from None
        temps = []
    finally:
        for tmp, _ in temps:
            Path(tmp).unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    write_texts_atomic([(path, text)])

