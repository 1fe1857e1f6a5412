"""Worker processes and how the server drives them: one task at a time over a pipe, each under a
deadline, killed on cancel or timeout.

Processes come from a forkserver that has the planner (and matplotlib) imported, so a start
costs milliseconds. Each one is handed the read end of its own *lifeline* pipe whose write end
only the server holds: when the server dies — even by `kill -9` — the pipe reads EOF and the
worker exits at once (a thread in the worker blocks on it). Without it a killed server's solves
went on for their whole time limit: their parent is the forkserver, which outlives the server as
long as any of its children runs.

`RenderPool` draws timelines in such processes, off the request path; the job queue
(`api.jobs`) runs solves in them.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from api import worker

log = logging.getLogger(__name__)

# imported once in the forkserver, inherited by every worker
PRELOAD = ["api.worker", "planner.solve", "planner.search", "planner.cpsat", "api.timeline"]
TASKS_PER_PROCESS = 500  # then a fresh process, to bound any memory growth


def context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


class WorkerProcess:
    """One long-lived worker process, the parent's end of its task pipe and of its lifeline."""

    def __init__(self, ctx: multiprocessing.context.BaseContext, name: str = "pipeplan-worker",
                 memory_mb: int = 0) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        lifeline_r, self._lifeline_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=worker.serve, args=(child, lifeline_r, memory_mb), daemon=True,
                                name=name)
        self.proc.start()
        child.close()
        lifeline_r.close()
        self.tasks = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        else:
            try:
                self.conn.send(None)
            except OSError:
                self.proc.kill()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()
        self._lifeline_w.close()

    def _exit_status(self) -> str:
        """How the process ended, once reaped (its exit code is None until then): "exit code 3",
        "killed by signal SIGKILL (the out-of-memory killer sends it)"."""
        self.proc.join(1.0)
        code = self.proc.exitcode
        if code is None:
            return "no exit status yet"
        if code < 0:
            import signal

            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            hint = " (the out-of-memory killer sends it)" if name == "SIGKILL" else ""
            return f"killed by {name}{hint}"
        return f"exit code {code}"

    def run(self, payload: dict[str, Any], deadline_s: float,
            cancelled: Callable[[], bool]) -> tuple[str, Any]:
        """Send one task and wait for its answer: `("ok" | "user" | "internal", value)`, or
        `("timeout", None)` past the deadline, `("cancelled", None)` once `cancelled()` is true,
        `("died", how it ended)` if the process died. Anything but ok/user/internal leaves the
        process unusable (the caller kills it)."""
        self.tasks += 1
        try:
            self.conn.send(payload)
        except (BrokenPipeError, ConnectionResetError, EOFError):  # died before it got the task
            return "died", self._exit_status()
        deadline = time.monotonic() + deadline_s
        while True:
            if cancelled():
                return "cancelled", None
            ready = multiprocessing.connection.wait([self.conn, self.proc.sentinel], timeout=0.05)
            if self.conn in ready:
                try:
                    return self.conn.recv()
                except (EOFError, OSError):
                    return "died", self._exit_status()
            if self.proc.sentinel in ready:
                return "died", self._exit_status()
            if time.monotonic() > deadline:
                return "timeout", None


class QueueFull(Exception):
    """Every worker is busy and the queue is full."""


@dataclass(eq=False)
class RenderTask:
    key: str
    payload: dict[str, Any]
    future: Future[tuple[str, Any]] = field(default_factory=Future)


class RenderPool:
    """Draws timelines in worker processes: `submit(key, payload)` returns a future of
    `(status, value)`; the same key while one is in flight joins it."""

    def __init__(self, workers: int, queue_size: int, timeout_s: float, memory_mb: int = 0) -> None:
        self.workers, self.capacity, self.timeout_s = workers, workers + queue_size, timeout_s
        self.memory_mb = memory_mb
        self._ctx = context()
        self._queue: queue.Queue[RenderTask | None] = queue.Queue()
        self._lock = threading.Lock()
        self._inflight: dict[str, RenderTask] = {}
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.procs: dict[int, WorkerProcess] = {}

    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._dispatch, name=f"pipeplan-render-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()

    def depth(self) -> int:
        with self._lock:
            return len(self._inflight)

    def alive(self) -> bool:
        return all(t.is_alive() for t in self._threads) and bool(self._threads)

    def submit(self, key: str, payload: dict[str, Any]) -> Future[tuple[str, Any]]:
        with self._lock:
            if self._stopped:
                raise QueueFull("the server is shutting down")
            task = self._inflight.get(key)
            if task is not None:
                return task.future
            if len(self._inflight) >= self.capacity:
                raise QueueFull(f"{len(self._inflight)} renders in flight (capacity {self.capacity})")
            task = RenderTask(key, payload)
            self._inflight[key] = task
        self._queue.put(task)
        return task.future

    def _dispatch(self) -> None:
        proc: WorkerProcess | None = None
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                try:
                    if proc is None or not proc.alive() or proc.tasks >= TASKS_PER_PROCESS:
                        if proc is not None:
                            self.procs.pop(id(proc), None)
                            proc.close()
                        proc = WorkerProcess(self._ctx, "pipeplan-render", self.memory_mb)
                        self.procs[id(proc)] = proc
                    result = proc.run(task.payload, self.timeout_s, lambda: False)
                    if result[0] not in ("ok", "user", "internal"):
                        self.procs.pop(id(proc), None)
                        proc.close(kill=True)
                        proc = None
                except Exception as exc:  # noqa: BLE001 - never let a dispatcher thread die
                    log.exception("render %s failed in the dispatcher", task.key)
                    result = ("internal", f"{type(exc).__name__}: {exc}")
                with self._lock:
                    self._inflight.pop(task.key, None)
                task.future.set_result(result)
        finally:
            if proc is not None:
                self.procs.pop(id(proc), None)
                proc.close()
