"""A deadline on a step that runs the user's code before any peer can notice it hanging.

The ranks' timeouts cover every step they take together (joining the process group, the
gradient all-reduces, the first batch's comparison): a rank stuck in its own code is named by
the peers waiting for it. Before that, a step that only runs the user's code — the launcher's
pre-flight (build_model, make_batch, one forward to trace the model), a rank's setup under
torchrun, where every rank runs the same code and so hangs alike — has nobody to wait for it:
a forward that hung there held the job silently for ever. `Deadline` (a rank) ends the process
after `seconds`, `alarm` (the launcher) raises in it, with a message saying which step did not
finish."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from planner.errors import PipeplanError


def message(what: str, seconds: float) -> str:
    return (f"{what} did not finish within {seconds:g} s (--timeout): the model's code is waiting "
            "for something (a forward, build_model or make_batch that hangs); if it only needs "
            "longer, raise --timeout")


class Deadline:
    """From now on, watch: unless `cancel()` comes within `seconds`, call `expire(message)` from
    a watching thread (which must end the process: the watched code cannot be interrupted)."""

    def __init__(self, seconds: float, what: str, expire: Callable[[str], None]) -> None:
        self._done = threading.Event()

        def watch() -> None:
            if not self._done.wait(seconds):
                expire(message(what, seconds))

        threading.Thread(target=watch, name="pipeplan-deadline", daemon=True).start()

    def cancel(self) -> None:
        self._done.set()


class DeadlinePassed(PipeplanError):
    """Raised in the main thread by `alarm`; `message` as raised (code the exception passes
    through may append to its text: torch.fx adds the node it was running)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@contextmanager
def alarm(seconds: float, what: str) -> Iterator[None]:
    """Run the block in the main thread; if it has not finished after `seconds`, raise
    DeadlinePassed in it (a signal: it wakes a sleep or a wait, where a watching thread could
    only end the process, and the launcher runs inside other programs: the tests, a notebook).
    Elsewhere than in the main thread, no deadline."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise DeadlinePassed(message(what, seconds))

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
