"""Load a user's model file (`model.py`) and check it follows the model contract.

A model file is plain Python defining `build_model() -> nn.Module`,
`make_batch(batch_size) -> (inputs_tuple, target)` and `loss_fn(output, target) -> Tensor`.
Every way a file can fail to load (missing, syntax error, missing function, a function that
raises) becomes a `PipeplanError` naming the file, the function and what to do.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.errors import PipeplanError

REQUIRED = ("build_model", "make_batch", "loss_fn")
_HINTS = {
    "build_model": "def build_model() -> torch.nn.Module",
    "make_batch": "def make_batch(batch_size: int) -> tuple[tuple[Tensor, ...], Tensor]",
    "loss_fn": "def loss_fn(output, target) -> Tensor",
}


# torch.compile's backward frees its saved tensors ("donated buffers"): a second gradient over
# the same graph, as the profiler takes to time B and W apart and ZB-H1 takes to run them apart,
# is refused
DONATED = "donated buffers"
DONATED_ADVICE = (
    "a torch.compile'd module frees what its backward saved (donated buffers), and pipeplan "
    "differentiates its graph twice: once for the inputs' gradients, once for the weights' (the "
    "profiler to time them apart, ZB-H1 to run them apart). Add "
    "`import torch._functorch.config; torch._functorch.config.donated_buffer = False` to the "
    "model file, or compile the module only for 1F1B training")


# torch.utils.checkpoint(use_reentrant=True) refuses `autograd.grad`, which B and W apart use
REENTRANT = "When use_reentrant=True, torch.utils.checkpoint is incompatible"
REENTRANT_ADVICE = (
    "the model calls torch.utils.checkpoint with use_reentrant=True, which refuses "
    "torch.autograd.grad: pipeplan takes the inputs' and the weights' gradients apart (the "
    "profiler to time them, ZB-H1 to run them). Pass use_reentrant=False to checkpoint (or let "
    "pipeplan recompute: plan --recompute / the planner's choice)")


def twice_refused(exc: BaseException) -> str | None:
    """The advice for an error a model raises because its graph refuses to be differentiated
    twice with `autograd.grad` (torch.compile's donated buffers, a reentrant checkpoint), or
    None: what the profiler and ZB-H1's runtime both say instead of a traceback."""
    text = str(exc)
    return DONATED_ADVICE if DONATED in text else REENTRANT_ADVICE if REENTRANT in text else None


def file_sha256(path: str | Path) -> str:
    """sha256 of the file's bytes (a plan records it; the runtime checks it)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@dataclass(frozen=True)
class ModelFile:
    path: str
    sha256: str
    build_model: Callable[[], Any]
    make_batch: Callable[[int], Any]
    loss_fn: Callable[[Any, Any], Any]
    # optional `tp_plan(model) -> {module-name pattern: style}` (see runtime.tensor_parallel)
    tp_plan: Callable[[Any], Any] | None = None
    # make_batch has a `step` parameter (`make_batch(batch_size, step)`): the runtime passes
    # each step's index, so a make_batch that walks a dataset continues where a checkpoint
    # stopped after --resume (other callers pass 0)
    batch_takes_step: bool = False


def _takes_step(fn: Callable[..., Any]) -> bool:
    import inspect

    try:
        return "step" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def user_line(exc: BaseException, path: Path) -> str:
    """The innermost traceback line inside the user's file, e.g. ' (line 12: x = 1 / 0)'."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if Path(f.filename) == path]
    if not frames:
        return ""
    f = frames[-1]
    return f" (line {f.lineno}: {(f.line or '').strip()})"


def call_user(model_file_path: str | Path, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call a function from a model file, turning any exception into a PipeplanError."""
    path = Path(model_file_path).resolve()
    try:
        return fn(*args)
    except PipeplanError:
        raise
    except SystemExit as exc:  # sys.exit() in a model function: not the end of the command
        raise PipeplanError(
            f"{path}: {name}({', '.join(map(_describe, args))}) called sys.exit({exc.code!r})"
            f"{user_line(exc, path)}. {name} must return, not exit; fix it in {path.name}."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any failure in user code is reported, not raised
        raise PipeplanError(
            f"{path}: {name}({', '.join(map(_describe, args))}) raised {type(exc).__name__}: "
            f"{_first_lines(exc)}{user_line(exc, path)}. Fix {name} in {path.name} (try running it by hand)."
        ) from exc


def _describe(arg: Any) -> str:
    """An argument in an error message: a tensor by its shape and dtype, not its values."""
    import torch

    if isinstance(arg, torch.Tensor):
        return f"<tensor {tuple(arg.shape)} {str(arg.dtype).removeprefix('torch.')}>"
    text = repr(arg)
    return text if len(text) <= 120 else f"<{type(arg).__name__}: {text[:80]}...>"


def _first_lines(exc: BaseException, most: int = 600) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return text if len(text) <= most else text[:most] + "..."


def load_model_file(path: str | Path) -> ModelFile:
    """Import `path` as a module and return its three contract functions."""
    from planner.io import cannot_read, is_readable_file, not_a_file

    path = Path(path)
    if not is_readable_file(path):

        raise PipeplanError(
            f"{path}: {not_a_file(path) if path.exists() else 'no such model file'}. Give the path "
            "of a Python model file defining "
            "build_model(), make_batch(batch_size) and loss_fn(output, target)."
        )
    path = path.resolve()
    module_name = f"pipeplan_user_model_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise PipeplanError(f"{path}: cannot be imported as Python; give a .py file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look modules up by name
    # the file's own folder, as `python file.py` has it, so the file can import a helper module
    # beside it; last, so a helper named like one of ours (planner, runtime) shadows nothing
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except PermissionError as exc:  # the file itself unreadable
        sys.modules.pop(module_name, None)
        if exc.filename is not None and Path(exc.filename) == path:
            raise PipeplanError(cannot_read(path, exc)) from None
        raise PipeplanError(
            f"{path}: importing the file raised PermissionError: {exc}{user_line(exc, path)}. "
            "Fix the module-level code of the file (run `python <file>` to see it)."
        ) from exc
    except SyntaxError as exc:
        sys.modules.pop(module_name, None)
        where = f" at line {exc.lineno}" if exc.lineno else ""  # none for a file holding NUL bytes
        raise PipeplanError(
            f"{path}: syntax error{where}: {exc.msg}. Fix the file and try again."
        ) from None
    except SystemExit as exc:  # sys.exit() / exit() at module level: not the end of the command
        sys.modules.pop(module_name, None)
        raise PipeplanError(
            f"{path}: importing the file called sys.exit({exc.code!r}){user_line(exc, path)}. A model "
            "file must define build_model, make_batch and loss_fn without exiting; put a script's "
            "own code under `if __name__ == \"__main__\":`"
        ) from None
    except Exception as exc:  # noqa: BLE001
        sys.modules.pop(module_name, None)
        raise PipeplanError(
            f"{path}: importing the file raised {type(exc).__name__}: {exc}{user_line(exc, path)}. "
            "Fix the module-level code of the file (run `python <file>` to see it)."
        ) from exc
    missing = [name for name in REQUIRED if not callable(getattr(module, name, None))]
    if missing:
        wanted = "; ".join(_HINTS[m] for m in missing)
        raise PipeplanError(
            f"{path}: missing function{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)}. A model file must define: {wanted}."
        )
    import torch

    if isinstance(module.build_model, torch.nn.Module):
        raise PipeplanError(
            f"{path}: build_model is a {type(module.build_model).__name__} module, not a function "
            "that builds one (each process builds its own model): define "
            "`def build_model() -> torch.nn.Module` returning it.")
    return ModelFile(
        path=str(path),
        sha256=file_sha256(path),
        build_model=module.build_model,
        make_batch=module.make_batch,
        loss_fn=module.loss_fn,
        tp_plan=tp if callable(tp := getattr(module, "tp_plan", None)) else None,
        batch_takes_step=_takes_step(module.make_batch),
    )


def build_checked(mf: ModelFile, batch_size: int | None = None) -> Any:
    """`build_model()`, checked to return an nn.Module. With `batch_size`, a model with lazy
    modules (`nn.LazyLinear`, ...) is initialised as well (`materialize_lazy`)."""
    import torch

    model = call_user(mf.path, "build_model", mf.build_model)
    if not isinstance(model, torch.nn.Module):
        raise PipeplanError(
            f"{mf.path}: build_model() returned {type(model).__name__}, not a torch.nn.Module. "
            "Return the model object."
        )
    if batch_size is not None:
        materialize_lazy(mf, model, batch_size)
    return model


def eval_mode_note(mf: ModelFile, model: Any) -> str | None:
    """Every module trains in the mode `build_model()` left it in (a BatchNorm it put in eval
    mode stays frozen, as in a loop of training steps on that model): where the model itself is
    in eval mode (as `from_pretrained` leaves it), a note saying so, else None."""
    if getattr(model, "training", True):
        return None
    return (f"{mf.path}: build_model() returned the model in eval mode (as transformers' "
            "from_pretrained does): it is profiled and trained so, with dropout off and batch norm "
            "on its running statistics; call model.train() in build_model to train it in training mode")


def materialize_lazy(mf: ModelFile, model: Any, batch_size: int) -> None:
    """Initialise the parameters and buffers of lazy modules (`nn.LazyLinear`, ...) the way
    a training loop's first forward does, so that every process holds the same model before
    any of it is cut into stages: one forward of `make_batch(batch_size)` under no_grad, in
    eval mode (no running statistics move), drawing from the random state `build_model()`
    left (whatever `make_batch` draws is given back). Nothing happens without lazy modules."""
    import torch
    from torch.nn.parameter import is_lazy

    if not any(is_lazy(t) for t in (*model.parameters(), *model.buffers())):
        return
    state = torch.get_rng_state()
    inputs, _ = batch_checked(mf, batch_size)
    torch.set_rng_state(state)
    training = {m: m.training for m in model.modules()}
    model.eval()
    try:
        with torch.no_grad():
            call_user(mf.path, "the model's first forward (initialising its lazy modules)", model, *inputs)
    finally:
        for m, flag in training.items():
            m.training = flag
    if any(is_lazy(t) for t in (*model.parameters(), *model.buffers())):
        raise PipeplanError(
            f"{mf.path}: the model has lazy modules (nn.LazyLinear, ...) that one forward of "
            f"make_batch({batch_size}) does not initialise: call them in forward, or give their sizes")


def batch_checked(mf: ModelFile, batch_size: int, step: int = 0) -> tuple[tuple[Any, ...], Any]:
    """`make_batch(batch_size)` (with `step` where it takes one: `ModelFile.batch_takes_step`),
    checked to return `(tuple_of_tensors, target)`."""
    import functools

    import torch

    fn = functools.partial(mf.make_batch, step=step) if mf.batch_takes_step else mf.make_batch
    batch = call_user(mf.path, "make_batch", fn, batch_size)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise PipeplanError(
            f"{mf.path}: make_batch({batch_size}) must return (inputs, target) where inputs is a "
            f"tuple of tensors; it returned {type(batch).__name__}"
        )
    inputs, target = batch
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not (isinstance(inputs, tuple | list) and all(isinstance(t, torch.Tensor) for t in inputs)):
        raise PipeplanError(
            f"{mf.path}: make_batch({batch_size}) must return (inputs, target) with inputs a "
            "tuple of tensors (the model's positional arguments)"
        )
    # training splits every input and the target into microbatches along their first dimension
    for k, t in enumerate(inputs):
        if t.dim() == 0 or t.shape[0] != batch_size:
            raise PipeplanError(
                f"{mf.path}: make_batch({batch_size}): input {k} has shape {tuple(t.shape)}; every "
                f"input's first dimension must be the batch ({batch_size}): training splits the "
                "inputs into microbatches along it")
    if not isinstance(target, torch.Tensor):
        raise PipeplanError(
            f"{mf.path}: make_batch({batch_size}) returned a target of type {type(target).__name__}; "
            "the target must be one tensor whose first dimension is the batch (training splits it "
            "into microbatches). Stack several targets into one tensor, or compute them in loss_fn")
    if target.dim() == 0 or target.shape[0] != batch_size:
        raise PipeplanError(
            f"{mf.path}: make_batch({batch_size}): the target has shape {tuple(target.shape)}; its "
            f"first dimension must be the batch ({batch_size}): training splits it into microbatches "
            "along it")
    return tuple(inputs), target


def loss_checked(mf: ModelFile, output: Any, target: Any) -> Any:
    """`loss_fn(output, target)`, checked to return a scalar floating-point tensor (training
    calls `.backward()` on it)."""
    import torch

    loss = call_user(mf.path, "loss_fn", mf.loss_fn, output, target)
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
        what = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise PipeplanError(
            f"{mf.path}: loss_fn(output, target) returned {what}; it must return a scalar "
            "floating-point tensor (e.g. the mean loss over the batch). Reduce it, e.g. with .mean()."
        )
    return loss
