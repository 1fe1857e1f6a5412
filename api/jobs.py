"""The job queue: a bounded pool of solver processes, so solves never run on the event loop.

`workers` dispatcher threads each drive one long-lived solver process (forked from a forkserver
that has the planner imported, so a start costs milliseconds, not an interpreter start), which
solves one task at a time; a cancelled or overdue solve is stopped by killing the process, and a
fresh one replaces it (also after `TASKS_PER_PROCESS` tasks, to bound any memory growth). At most `workers + queue_size` jobs are in flight; `submit` raises `QueueFull` beyond
that (the route answers 503 with Retry-After). The same request while one is in flight joins
it instead of solving twice. `cancel` kills a running process or drops a queued job. Every
state change is written to storage first, so a job is never silently lost: what a stopped
server leaves unfinished is marked failed at the next start (`Storage.fail_unfinished_jobs`).

A job's `Task.future` (a `concurrent.futures.Future`, loop-agnostic) resolves to its `Outcome`
once storage says so; HTTP handlers await it with `asyncio.wrap_future`.
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
from multiprocessing import forkserver
from typing import Any

from api import worker
from api.storage import JobRow, Storage

log = logging.getLogger(__name__)

PRELOAD = ["api.worker", "planner.solve", "planner.cpsat"]  # imported once in the forkserver, inherited by every solve


TASKS_PER_PROCESS = 500


class QueueFull(Exception):
    """Every worker is busy and the queue is full."""


@dataclass(frozen=True)
class Outcome:
    status: str  # succeeded | failed | cancelled
    plan_id: str | None = None
    result: Any = None
    error: str | None = None
    error_kind: str | None = None  # user | internal | timeout | cancelled | shutdown


# (status, value) from the worker ("ok" | "user" | "internal") -> what to record
ResultHandler = Callable[[str, Any], Outcome]


@dataclass(eq=False)
class Task:
    job_id: str
    key: str
    payload: dict[str, Any]
    deadline_s: float
    on_result: ResultHandler
    future: Future[Outcome] = field(default_factory=Future)
    cancel_reason: str | None = None  # set => stop as soon as possible
    proc: multiprocessing.process.BaseProcess | None = None  # the process solving it, once running


class _Solver:
    """One long-lived solver process and the parent's end of its pipe."""

    def __init__(self, ctx: multiprocessing.context.BaseContext) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=worker.serve, args=(child,), daemon=True, name="pipeplan-solver")
        self.proc.start()
        child.close()
        self.tasks = 0

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


def _context() -> multiprocessing.context.BaseContext:
    if "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return multiprocessing.get_context("spawn")


class JobManager:
    def __init__(self, storage: Storage, workers: int, queue_size: int) -> None:
        self.storage = storage
        self.workers = workers
        self.capacity = workers + queue_size
        self._ctx = _context()
        self._queue: queue.Queue[Task | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finish_lock = threading.Lock()
        self._tasks: dict[str, Task] = {}  # job id -> task, while in flight
        self._by_key: dict[str, Task] = {}
        self._running = 0
        self._threads: list[threading.Thread] = []
        self._stopped = False

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._ctx.get_start_method() == "forkserver":
            threading.Thread(target=forkserver.ensure_running, daemon=True).start()
        for i in range(self.workers):
            t = threading.Thread(target=self._dispatch, name=f"pipeplan-job-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Cancel everything in flight (recorded as failed: the server stopped) and join."""
        with self._lock:
            self._stopped = True
            tasks = list(self._tasks.values())
        for task in tasks:
            self._request_cancel(task, "shutdown")
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()

    # ------------------------------------------------------------ public
    def stats(self) -> dict[str, int]:
        with self._lock:
            inflight = len(self._tasks)
            running = self._running
        return {"workers": self.workers, "running": running, "queued": max(0, inflight - running),
                "capacity": self.capacity}

    def submit(self, kind: str, key: str, profile_id: str, request: dict[str, Any],
               payload: dict[str, Any], deadline_s: float, on_result: ResultHandler) -> tuple[Task, bool]:
        """Queue a task; returns (task, created). Joins an in-flight task with the same key."""
        with self._lock:
            if self._stopped:
                raise QueueFull("the server is shutting down")
            existing = self._by_key.get(key)
            if existing is not None:
                return existing, False
            if len(self._tasks) >= self.capacity:
                raise QueueFull(f"{len(self._tasks)} jobs in flight (capacity {self.capacity})")
            job = self.storage.create_job(kind, key, profile_id, request)
            task = Task(job.id, key, payload, deadline_s, on_result)
            self._tasks[job.id] = task
            self._by_key[key] = task
        self._queue.put(task)
        return task, True

    def task(self, job_id: str) -> Task | None:
        with self._lock:
            return self._tasks.get(job_id)

    def cancel(self, job_id: str) -> JobRow | None:
        """Cancel a queued or running job; returns its row (None if unknown)."""
        task = self.task(job_id)
        if task is not None:
            self._request_cancel(task, "cancelled")
            self._finish(task, Outcome("cancelled", error="cancelled by a DELETE request",
                                       error_kind="cancelled"))
        else:
            self.storage.finish_job(job_id, "cancelled", error="cancelled by a DELETE request",
                                    error_kind="cancelled")
        return self.storage.get_job(job_id)

    # ------------------------------------------------------------ internals
    def _request_cancel(self, task: Task, reason: str) -> None:
        """Flag the task; its dispatcher sees the flag within 50 ms and kills the solver process
        (only the dispatcher kills, so a cancel can never hit the process's next task)."""
        task.cancel_reason = task.cancel_reason or reason

    def _finish(self, task: Task, outcome: Outcome) -> None:
        """Record the outcome, forget the task, resolve its future. A cancel and the dispatcher
        may both finish a task: the first wins, in storage and in the future alike."""
        with self._finish_lock:
            self.storage.finish_job(task.job_id, outcome.status, plan_id=outcome.plan_id,
                                    result=outcome.result, error=outcome.error,
                                    error_kind=outcome.error_kind)
            with self._lock:
                if self._tasks.pop(task.job_id, None) is not None and self._by_key.get(task.key) is task:
                    del self._by_key[task.key]
            if not task.future.done():
                task.future.set_result(outcome)

    def _dispatch(self) -> None:
        solver: _Solver | None = None
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                if task.cancel_reason is not None or not self.storage.mark_running(task.job_id):
                    self._finish(task, self._cancelled(task))
                    continue
                with self._lock:
                    self._running += 1
                try:
                    if solver is None or not solver.proc.is_alive() or solver.tasks >= TASKS_PER_PROCESS:
                        if solver is not None:
                            solver.close()
                        solver = _Solver(self._ctx)
                    outcome, healthy = self._run(task, solver)
                    if not healthy:  # killed (cancel, timeout) or died: start a fresh one next time
                        solver.close(kill=True)
                        solver = None
                except Exception as exc:  # noqa: BLE001 - never let a dispatcher thread die
                    log.exception("job %s failed in the dispatcher", task.job_id)
                    outcome = Outcome("failed", error=f"internal error: {exc}", error_kind="internal")
                finally:
                    with self._lock:
                        self._running -= 1
                self._finish(task, outcome)
        finally:
            if solver is not None:
                solver.close()

    @staticmethod
    def _cancelled(task: Task) -> Outcome:
        if task.cancel_reason == "shutdown":
            return Outcome("failed", error="the server stopped before this job finished; "
                           "send the request again", error_kind="shutdown")
        return Outcome("cancelled", error="cancelled by a DELETE request", error_kind="cancelled")

    def _run(self, task: Task, solver: _Solver) -> tuple[Outcome, bool]:
        """Solve `task` on `solver`; returns the outcome and whether the solver can be reused."""
        task.proc = solver.proc
        solver.tasks += 1
        solver.conn.send(task.payload)
        deadline = time.monotonic() + task.deadline_s
        message: tuple[str, Any] | None = None
        while True:
            if task.cancel_reason is not None:
                return self._cancelled(task), False
            ready = multiprocessing.connection.wait([solver.conn, solver.proc.sentinel], timeout=0.05)
            if solver.conn in ready:
                try:
                    message = solver.conn.recv()
                except (EOFError, OSError):
                    message = None
                break
            if solver.proc.sentinel in ready:
                break
            if time.monotonic() > deadline:
                return Outcome("failed", error=f"the solve took longer than {task.deadline_s:.0f} s "
                               "and was stopped; lower time_limit_s or use a faster method",
                               error_kind="timeout"), False
        task.proc = None
        if task.cancel_reason is not None:
            return self._cancelled(task), message is not None
        if message is None:
            return Outcome("failed", error=f"the solver process died (exit code {solver.proc.exitcode})",
                           error_kind="internal"), False
        status, value = message
        try:
            return task.on_result(status, value), True
        except Exception as exc:  # noqa: BLE001 - a storage or result error fails this job only
            log.exception("storing the result of job %s failed", task.job_id)
            return Outcome("failed", error=f"internal error storing the result: {exc}",
                           error_kind="internal"), True
