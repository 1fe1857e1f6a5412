"""Checkpoints of a pipeline run: the full model state dict plus optimizer state, by name.

A checkpoint directory holds
- `model.pt`: the full state dict of the model (`build_model().load_state_dict(torch.load(...))`
  accepts it), merged from the stages;
- `optimizer.pt`: `{"state": {parameter name: optimizer state of that parameter}, ...}` keyed by
  the original model's parameter names (a tied parameter under each of its names), so a run on
  a different plan can resume from it;
- `meta.json`: steps done, seed, optimizer, learning rate and the training rule (weight decay,
  gradient clipping, the learning-rate schedule), and `state_digest`: which model it is (the
  names, shapes and dtypes of its state dict), so a --save into the checkpoint of another model
  is refused before training instead of replacing it (`check_same_model`).
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from planner.errors import PipeplanError, describe, first_line

if TYPE_CHECKING:
    from profiler.loader import ModelFile
    from runtime.progress import Counter

MODEL_FILE = "model.pt"
OPTIMIZER_FILE = "optimizer.pt"
META_FILE = "meta.json"
FILES = (MODEL_FILE, OPTIMIZER_FILE, META_FILE)
PREV = ".prev"  # the previous checkpoint's files while a save replaces them (`save`)
TMP = ".tmp"  # a file being written (`save`), renamed in place once all are
LOCK_FILE = ".pipeplan-save.lock"  # held by the run saving there (`lock_directory`)


def files_of(directory: str | Path) -> tuple[dict[str, Path], bool]:
    """The checkpoint's files in `directory` by name, and whether they are the previous
    checkpoint's (`.prev`: a save was interrupted while it renamed its files in). Where there is
    neither a meta.json nor a whole previous checkpoint, the plain names (`load` says what is
    missing)."""
    d = Path(directory)
    if not (d / META_FILE).is_file() and all((d / (n + PREV)).is_file() for n in FILES):
        return {n: d / (n + PREV) for n in FILES}, True
    return {n: d / n for n in FILES}, False


def holds_other_files(directory: str | Path) -> bool:
    """`directory` holds files but no checkpoint (no meta.json, nor a whole previous one): a
    --save there would overwrite someone's model.pt. What a save leaves when killed while
    writing (its own *.tmp and *.prev files) does not count: the same --save may go on there."""
    d = Path(directory)
    if not d.is_dir() or files_of(d)[0][META_FILE].is_file():
        return False
    ours = {n + end for n in FILES for end in (TMP, PREV)} | {LOCK_FILE}
    return any(p.name not in ours for p in d.iterdir())


def lock_directory(directory: str | Path) -> int | None:
    """Hold `directory`'s save lock (an exclusive `flock` of its LOCK_FILE, which names the
    holder's pid) for as long as the returned descriptor stays open (the launcher closes it
    when its ranks are done; the kernel lets go of it when the process ends, even by kill -9). A second run saving into the
    same directory (a job started twice, a scheduler's retry while the first still ran) wrote
    the same *.tmp files: one run failed with a traceback, and their files could mix. Raises
    PipeplanError naming the holder; None where locks are not available (not POSIX)."""
    import os

    try:
        import fcntl
    except ImportError:
        return None
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(d / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError:  # another user's lock file in a shared directory: a read-only
            fd = os.open(d / LOCK_FILE, os.O_RDONLY)  # descriptor takes a flock as well
    except OSError:  # no lock file can be had there: as before, unlocked (`save` says why it fails)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip()
        os.close(fd)
        raise PipeplanError(
            f"--save {d}: another run (pid {holder or '?'}) is saving its checkpoints there; "
            "wait for it to end, or --save to another directory") from None
    except OSError:  # a file system without locks (some network mounts): as before
        os.close(fd)
        return None
    try:  # (the pid only informs a second run's message: a read-only descriptor or a full disk
        os.ftruncate(fd, 0)  # leaves it out)
        os.write(fd, str(os.getpid()).encode())
    except OSError:
        pass
    return fd


def resume_data_note(mf: ModelFile, start_step: int) -> str | None:
    """--resume past step 0 with a make_batch that is told no step: one drawing from the
    seeded generators continues as it would have, one walking a dataset with a cursor of its
    own starts again at its first rows (it retrained on steps 1-2's rows after a resume at 2)."""
    if start_step <= 0 or mf.batch_takes_step:
        return None
    return (f"--resume at step {start_step}: make_batch(batch_size) is told no step, so one that "
            "walks a dataset in order (a cursor of its own) starts again at its first rows; one that "
            "draws from torch's, random's or numpy's seeded generators continues as it would have. "
            "Give it a step parameter, make_batch(batch_size, step=0), to continue where the "
            "checkpoint stopped (each step's index is passed)")


def state_digest(state: dict[str, torch.Tensor]) -> str:
    """What identifies a model's checkpoint: the names, shapes and dtypes of its state dict (not
    its values, which training changes)."""
    import hashlib

    rows = sorted(f"{k}:{tuple(v.shape)}:{v.dtype}" for k, v in state.items() if torch.is_tensor(v))
    return hashlib.sha256("\n".join(rows).encode()).hexdigest()


def check_same_model(directory: str | Path, state: dict[str, torch.Tensor], model_path: str) -> None:
    """--save into a directory that holds another model's checkpoint would replace it: refused.
    Checkpoints written before `state_digest` was kept are not checked."""
    paths, _ = files_of(directory)
    if not paths[META_FILE].is_file():
        return
    try:
        kept = json.loads(paths[META_FILE].read_text()).get("state_digest")
    except (OSError, ValueError, AttributeError):
        return  # (--save replaces a damaged meta.json; --resume says what is wrong with it)
    if isinstance(kept, str) and kept != state_digest(state):
        raise PipeplanError(
            f"--save {directory}: the directory holds the checkpoint of another model (its state "
            f"dict's names, shapes or dtypes differ from {model_path}'s), which this run would "
            "replace: --save to another directory, or remove that checkpoint first")


def _keep(src: Path, dst: Path, counter: Counter | None = None) -> None:
    """`dst` a second name of `src`'s data (a hard link; a copy where links are refused, as
    network and FUSE file systems often do: its bytes told to `counter` as the save's, since the
    other ranks wait on that count while it runs)."""
    import os
    import shutil

    try:
        os.link(src, dst)
    except OSError:
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            out = fout if counter is None else _CountingFile(fout, counter)
            shutil.copyfileobj(fin, out, _CountingFile.CHUNK)  # type: ignore[misc]
        shutil.copystat(src, dst)


def optimizer_state_by_name(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter]
                            ) -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name, p in params.items():
        if p in opt.state:
            # a DTensor (state of a tensor-parallel parameter) is gathered whole: every rank of
            # its TP group must call this
            out[name] = {k: (_whole(v).detach().cpu().clone() if torch.is_tensor(v) else v)
                         for k, v in opt.state[p].items()}
    return out


def load_optimizer_state(opt: torch.optim.Optimizer, params: dict[str, nn.Parameter],
                         state: dict[str, dict[str, torch.Tensor]]) -> None:
    for name, p in params.items():
        if name in state:
            opt.state[p] = {k: (_like(v.to(p.device), p) if torch.is_tensor(v) and k != "step" else v)
                            for k, v in state[name].items()}


def _whole(t: torch.Tensor) -> torch.Tensor:
    from runtime.tensor_parallel import full

    return full(t)


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    from runtime.tensor_parallel import like

    return like(value, param)


class _CountingFile:
    """A file written in pieces of at most `CHUNK` bytes, each added to `counter` once written:
    what rank 0's heartbeat reports while a large checkpoint goes to disk (`runtime.progress`),
    where one tensor's write of several GB would otherwise show no progress until it ended."""

    CHUNK = 1 << 20

    def __init__(self, f: object, counter: Counter) -> None:
        self._f, self._counter = f, counter

    def write(self, data: bytes | memoryview) -> int:
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.CHUNK):
            piece = view[i:i + self.CHUNK]
            self._f.write(piece)  # type: ignore[attr-defined]
            self._counter.add(len(piece))
        return len(view)

    def flush(self) -> None:
        self._f.flush()  # type: ignore[attr-defined]


def _save_tensors(obj: object, path: Path, counter: Counter | None) -> None:
    if counter is None:
        torch.save(obj, path)
        return
    with open(path, "wb") as f:
        torch.save(obj, _CountingFile(f, counter))  # type: ignore[arg-type]


def save(directory: str | Path, model_state: dict[str, torch.Tensor],
         optimizer_state: dict[str, dict[str, torch.Tensor]], meta: dict[str, object],
         counter: Counter | None = None) -> None:
    """Write the checkpoint. All three files are written first, then renamed in place: a
    failure while writing (the slow part: a full disk) removes what it wrote and leaves the
    previous checkpoint whole, with a PipeplanError saying why. Before the renames the previous
    checkpoint's files get second names (`.prev`, hard links), then its meta.json goes, and the
    new one comes last: a crash between them leaves the previous checkpoint whole under those
    names, which `load` and --resume take (`files_of`), never new weights beside an old step
    count; the names go once the new checkpoint is in. `counter` (a `runtime.progress.Counter`)
    is told every MB written, for the ranks that wait on this write."""
    d = Path(directory)
    tmps: list[tuple[Path, Path]] = []
    try:
        d.mkdir(parents=True, exist_ok=True)
        for name, obj in ((MODEL_FILE, model_state), (OPTIMIZER_FILE, {"state": optimizer_state})):
            tmps.append((d / (name + TMP), d / name))
            _save_tensors(obj, tmps[-1][0], counter)
        tmps.append((d / (META_FILE + TMP), d / META_FILE))
        tmps[-1][0].write_text(json.dumps(meta, indent=2) + "\n")
    except (OSError, RuntimeError) as exc:  # torch.save reports a short write as RuntimeError
        for tmp, _ in tmps:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            describe(exc, 160)
        raise PipeplanError(f"--save {d}: the checkpoint could not be written ({why}); the training "
                            "of this run is not saved. Free space there, or --save to another "
                            "directory") from None
    if (d / META_FILE).is_file():  # (else a whole .prev set, if any, is the one to keep)
        for n in FILES:
            (d / (n + PREV)).unlink(missing_ok=True)
        for n in FILES:
            if (d / n).is_file():
                _keep(d / n, d / (n + PREV), counter)
    (d / META_FILE).unlink(missing_ok=True)
    for tmp, final in tmps:
        tmp.replace(final)
    for n in FILES:
        (d / (n + PREV)).unlink(missing_ok=True)


def state_bytes(model: nn.Module, optimizer: str) -> int:
    """About what `save` writes for `model` trained with `optimizer`: its state dict, and the
    optimizer's state (a momentum buffer, Adam's two moments) per trained parameter."""
    from planner.cost import OPTIMIZER_EXTRA_COPIES

    copies = OPTIMIZER_EXTRA_COPIES[optimizer]
    params = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    trained = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return params + copies * trained


def load(directory: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]], dict]:
    d = Path(directory)
    paths, _ = files_of(d)
    missing = [n for n in FILES if not paths[n].is_file()]
    if missing:
        unfinished = missing == [META_FILE] and (d / MODEL_FILE).is_file()
        raise PipeplanError(
            f"--resume {d}: not a checkpoint written by --save (missing {', '.join(missing)})"
            + ("; its --save was interrupted while renaming its files: resume from another "
               "checkpoint or start again" if unfinished else "")
        )
    loaded = []
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        try:  # tensors and plain containers only: what `save` writes
            loaded.append(torch.load(paths[name], map_location="cpu", weights_only=True))
        except Exception as exc:  # truncated, overwritten or not a checkpoint at all
            # (an unpickling error's own text advises weights_only=False: not for a file --save
            # wrote, which holds tensors only)
            why = "not a tensor checkpoint" if isinstance(exc, pickle.UnpicklingError) else \
                (f"{type(exc).__name__}: {first_line(str(exc), 160)}" if str(exc).strip() else
                 "empty" if paths[name].stat().st_size == 0 else type(exc).__name__)
            raise PipeplanError(
                f"--resume {d}: {name} cannot be read as a checkpoint written by --save ({why}); "
                "it is damaged or was written by something else: resume from another checkpoint "
                "or start again"
            ) from None
    model_state, opt = loaded
    if not isinstance(model_state, dict) or not isinstance(opt, dict) or "state" not in opt:
        raise PipeplanError(f"--resume {d}: {MODEL_FILE} / {OPTIMIZER_FILE} do not hold what --save "
                            "writes; resume from another checkpoint or start again")
    meta = json.loads(paths[META_FILE].read_text())
    return model_state, opt["state"], meta


def check_optimizer_state(model: nn.Module, state: dict[str, dict[str, torch.Tensor]],
                          directory: str | Path, model_path: str) -> None:
    """--resume: optimizer.pt's state belongs to `model`'s parameters (a name it has, each
    tensor of that parameter's shape), refused in one line before any rank starts; a moment of
    another shape failed in the first optimizer step with a traceback. A trained parameter
    without state is allowed (one that had no gradient before the save has none)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, entries in state.items():
        p = params.get(name)
        if p is None:
            raise PipeplanError(
                f"--resume {directory}: {OPTIMIZER_FILE} holds optimizer state for {name!r}, which "
                f"{model_path} has no parameter named: it was saved from another model or damaged; "
                "resume with the model it was saved from")
        for key, v in (entries.items() if isinstance(entries, dict) else ()):
            if torch.is_tensor(v) and v.dim() > 0 and tuple(v.shape) != tuple(p.shape):
                raise PipeplanError(
                    f"--resume {directory}: {OPTIMIZER_FILE} holds {key!r} of {name!r} with shape "
                    f"{tuple(v.shape)}, but the parameter's is {tuple(p.shape)}: it was saved from "
                    "another model or damaged; resume with the model it was saved from")


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor], directory: str | Path,
                     model_path: str) -> None:
    """`model.load_state_dict(state)` for --resume. Buffers the model does not persist
    (`register_buffer(..., persistent=False)`) are dropped from `state` first: checkpoints of
    earlier versions held a model-level one. A state that still does not fit is a PipeplanError
    with torch's whole message (which keys are missing or unexpected, which shapes differ)."""
    transient = {f"{name}.{b}" if name else b for name, mod in model.named_modules()
                 for b in getattr(mod, "_non_persistent_buffers_set", ())}
    try:
        model.load_state_dict({k: v for k, v in state.items() if k not in transient})
    except RuntimeError as exc:
        why = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise PipeplanError(f"--resume {directory}: the checkpoint does not fit {model_path} "
                            f"({why[:600]}); resume with the model it was saved from") from None
