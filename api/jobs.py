"""The job queue: a bounded pool of solver processes, so solves never run on the event loop.

`workers` dispatcher threads each drive one long-lived solver process (`api.pool.WorkerProcess`:
forked from a forkserver that has the planner imported, and exiting by itself when the server
dies), which solves one task at a time. Every solve runs under a deadline,
`planner.solve.solve_deadline_s` plus `solve_grace_s`: the heuristics' time limit; the search's
own wall-clock safety net (its budget is work: a deadline at the limit itself would cut the work
where the command line does not, and the same request would get another plan from another
server). Past it the process is killed (a fresh one replaces it) and the job fails with
error_kind "timeout". A comparison solves its methods one by one, each under its own deadline,
so one slow method costs its own row only. At most `workers + queue_size` jobs are in flight; `submit` raises
`QueueFull` beyond that (the route answers 503 with Retry-After). The same request while one is
in flight joins it instead of solving twice. `cancel` kills a running process or drops a queued
job. Every state change is written to storage first, so a job is never silently lost: what a
stopped server leaves unfinished is marked failed at the next start
(`Storage.fail_unfinished_jobs`).

A job's `Task.future` (a `concurrent.futures.Future`, loop-agnostic) resolves to its `Outcome`
once storage says so; HTTP handlers await it with `asyncio.wrap_future`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import forkserver
from typing import Any

from api.pool import TASKS_PER_PROCESS, QueueFull, WorkerProcess, context
from api.storage import JobRow, Storage
from planner.formats import PlanOptions
from planner.solve import solve_deadline_s

log = logging.getLogger(__name__)

__all__ = ["JobManager", "Outcome", "QueueFull", "Task"]


@dataclass(frozen=True)
class Outcome:
    status: str  # succeeded | failed | cancelled
    plan_id: str | None = None
    result: Any = None
    error: str | None = None
    error_kind: str | None = None  # user | quota | internal | timeout | cancelled | shutdown


# (status, value) from the worker ("ok" | "user" | "internal") -> what to record
ResultHandler = Callable[[str, Any], Outcome]
# (kind, method, status, seconds) after every solve: metrics
Observer = Callable[[str, str, str, float], None]


@dataclass(eq=False)
class Task:
    job_id: str
    key: str
    payload: dict[str, Any]
    grace_s: float  # per solve (per method for a comparison), past `solve_deadline_s`
    on_result: ResultHandler
    future: Future[Outcome] = field(default_factory=Future)
    cancel_reason: str | None = None  # set => stop as soon as possible


def stop_after_s(options: dict[str, Any], grace_s: float) -> float:
    """When a solve of `options` (a request's options, validated) is stopped."""
    return solve_deadline_s(PlanOptions.model_validate(options)) + grace_s


def timeout_message(method: str, deadline_s: float, limit_s: float) -> str:
    return (f"method {method!r} did not finish within its time budget ({limit_s:g} s time limit, "
            f"stopped after {deadline_s:g} s); raise options.time_limit_s (this server's cap is "
            "PIPEPLAN_MAX_TIME_LIMIT_S), plan a smaller cluster, or use a faster method")


class JobManager:
    def __init__(self, storage: Storage, workers: int, queue_size: int,
                 observe: Observer | None = None, memory_mb: int = 0) -> None:
        self.storage = storage
        self.memory_mb = memory_mb  # each solver process's limit (`api.worker.limit_memory`)
        self.workers = workers
        self.capacity = workers + queue_size
        self.observe = observe
        self._ctx = context()
        self._queue: queue.Queue[Task | None] = queue.Queue()
        self._lock = threading.Lock()
        self._finish_lock = threading.Lock()
        self._submit_lock = threading.Lock()  # submits one at a time (`submit`)
        self._tasks: dict[str, Task] = {}  # job id -> task, while in flight
        self._unstored: dict[str, Outcome] = {}  # finished, but the database refused the write
        self._by_key: dict[str, Task] = {}
        self._running = 0
        self._threads: list[threading.Thread] = []
        self._stopped = False
        self.procs: dict[int, WorkerProcess] = {}  # the live solver processes

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

    def alive(self) -> bool:
        """Every dispatcher thread is running (each drives one solver process)."""
        return bool(self._threads) and all(t.is_alive() for t in self._threads)

    # ------------------------------------------------------------ public
    def stats(self) -> dict[str, int]:
        with self._lock:
            inflight = len(self._tasks)
            running = self._running
        return {"workers": self.workers, "running": running, "queued": max(0, inflight - running),
                "capacity": self.capacity}

    def submit(self, kind: str, key: str, profile_id: str, request: dict[str, Any],
               payload: dict[str, Any], grace_s: float, on_result: ResultHandler,
               owner: str = "") -> tuple[Task, bool]:
        """Queue a task; returns (task, created). Joins an in-flight task with the same key."""
        # Submits take turns (the key join and the capacity check hold over the job's insert),
        # but the database write is made outside `_lock`: `stats()`, which the health routes
        # call on the event loop, takes it, and a write waiting for SQLite's lock (up to its
        # busy timeout) held /healthz and every other route 5 s (an outside review)
        with self._submit_lock:
            with self._lock:
                if self._stopped:
                    raise QueueFull("the server is shutting down")
                existing = self._by_key.get(key)
                if existing is not None:
                    return existing, False
                if len(self._tasks) >= self.capacity:
                    raise QueueFull(f"{len(self._tasks)} jobs in flight (capacity {self.capacity})")
            job = self.storage.create_job(kind, key, profile_id, request, owner)
            task = Task(job.id, key, payload, grace_s, on_result)
            with self._lock:
                stopped = self._stopped
                if not stopped:
                    self._tasks[job.id] = task
                    self._by_key[key] = task
            if stopped:  # the server began to stop during the insert: no dispatcher will run it
                self._store(job.id, Outcome("failed", error="the server stopped before this job "
                                            "started; send the request again", error_kind="shutdown"))
                raise QueueFull("the server is shutting down")
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
        may both finish a task: the first wins, in storage and in the future alike. Where the
        database refuses the write (a full disk), the job fails and that outcome is kept in
        memory (`unstored_outcome`: the job's answer) and written at the next finish; the
        dispatcher thread lives on either way."""
        with self._finish_lock:
            self._store_pending()
            if not self._store(task.job_id, outcome):
                outcome = Outcome("failed", error="the server could not store this job's outcome "
                                  "(its database refused the write; see the server's log); send "
                                  "the request again", error_kind="internal")
                self._unstored[task.job_id] = outcome
            with self._lock:
                if self._tasks.pop(task.job_id, None) is not None and self._by_key.get(task.key) is task:
                    del self._by_key[task.key]
            if not task.future.done():
                task.future.set_result(outcome)

    def _store(self, job_id: str, outcome: Outcome) -> bool:
        """Write a job's final state; False where the database refused it (logged)."""
        try:
            self.storage.finish_job(job_id, outcome.status, plan_id=outcome.plan_id,
                                    result=outcome.result, error=outcome.error,
                                    error_kind=outcome.error_kind)
            return True
        except Exception as exc:  # noqa: BLE001 - a full disk must not kill the dispatcher
            log.error("storing the outcome of job %s failed (%s: %s); kept in memory until a "
                      "write succeeds", job_id, type(exc).__name__, exc)
            return False

    def _store_pending(self) -> None:
        for job_id, outcome in list(self._unstored.items()):
            if self._store(job_id, outcome):
                del self._unstored[job_id]

    def flush_unstored(self) -> None:
        """Write the outcomes the database refused before, where it takes writes now."""
        if self._unstored:
            with self._finish_lock:
                self._store_pending()

    def unstored_ids(self) -> list[str]:
        """The jobs whose outcome the database refused so far (kept in memory)."""
        with self._finish_lock:
            return list(self._unstored)

    def unstored_outcome(self, job_id: str) -> Outcome | None:
        """The outcome of a finished job whose write the database refused (None: none)."""
        with self._finish_lock:
            return self._unstored.get(job_id)

    def _dispatch(self) -> None:
        holder: list[WorkerProcess | None] = [None]
        try:
            while True:
                task = self._queue.get()
                if task is None:
                    return
                try:
                    started = task.cancel_reason is None and self.storage.mark_running(task.job_id)
                except Exception as exc:  # noqa: BLE001 - a full disk must not kill the dispatcher
                    log.error("recording the start of job %s failed (%s: %s)", task.job_id,
                              type(exc).__name__, exc)
                    self._finish(task, Outcome(
                        "failed", error="the server could not record this job's start (its "
                        "database refused the write; see the server's log); send the request again",
                        error_kind="internal"))
                    continue
                if not started:
                    self._finish(task, self._cancelled(task))
                    continue
                with self._lock:
                    self._running += 1
                try:
                    outcome = self._run(task, holder)
                except Exception as exc:  # noqa: BLE001 - never let a dispatcher thread die
                    log.exception("job %s failed in the dispatcher", task.job_id)
                    outcome = Outcome("failed", error=f"internal error: {exc}", error_kind="internal")
                finally:
                    with self._lock:
                        self._running -= 1
                self._finish(task, outcome)
        finally:
            if holder[0] is not None:
                self._drop(holder, kill=False)

    def _drop(self, holder: list[WorkerProcess | None], kill: bool) -> None:
        proc = holder[0]
        if proc is not None:
            self.procs.pop(id(proc), None)
            proc.close(kill=kill)
            holder[0] = None

    def _solve(self, task: Task, payload: dict[str, Any], holder: list[WorkerProcess | None],
               deadline_s: float) -> tuple[str, Any]:
        """One solve on this dispatcher's process (started or replaced as needed), stopped after
        `deadline_s` (`stop_after_s`)."""
        proc = holder[0]
        if proc is None or not proc.alive() or proc.tasks >= TASKS_PER_PROCESS:
            if proc is not None:
                self._drop(holder, kill=False)
            proc = WorkerProcess(self._ctx, "pipeplan-solver", self.memory_mb)
            holder[0] = proc
            self.procs[id(proc)] = proc
        t0 = time.monotonic()
        status, value = proc.run(payload, deadline_s, lambda: task.cancel_reason is not None)
        if status not in ("ok", "user", "internal"):  # killed (cancel, timeout) or died
            self._drop(holder, kill=True)
        if self.observe is not None:
            self.observe(payload["kind"], payload["options"].get("method", "?"), status,
                         time.monotonic() - t0)
        return status, value

    @staticmethod
    def _cancelled(task: Task) -> Outcome:
        if task.cancel_reason == "shutdown":
            return Outcome("failed", error="the server stopped before this job finished; "
                           "send the request again", error_kind="shutdown")
        return Outcome("cancelled", error="cancelled by a DELETE request", error_kind="cancelled")

    def _run(self, task: Task, holder: list[WorkerProcess | None]) -> Outcome:
        payload = task.payload
        limit_s = float(payload["options"]["time_limit_s"])
        if payload["kind"] == "compare":  # one solve per method, each under its own deadline
            rows = []
            for method in payload["methods"]:
                options = payload["method_options"][method]
                deadline = stop_after_s(options, task.grace_s)
                status, value = self._solve(task, {**payload, "kind": "plan", "options": options}, holder,
                                            deadline)
                if task.cancel_reason is not None or status == "cancelled":
                    return self._cancelled(task)
                if status == "ok":
                    rows.append({"method": method, "plan": value["plan"]})
                elif status == "timeout":
                    rows.append({"method": method, "error": timeout_message(method, deadline, limit_s)})
                elif status == "died":
                    rows.append({"method": method, "error": f"the solver process died ({value})"})
                else:
                    rows.append({"method": method, "error": str(value)})
            status, value = "ok", {"rows": rows}
        else:
            deadline = stop_after_s(payload["options"], task.grace_s)
            status, value = self._solve(task, payload, holder, deadline)
        if task.cancel_reason is not None or status == "cancelled":
            return self._cancelled(task)
        if status == "timeout":
            method = payload["options"].get("method", "?")
            return Outcome("failed", error=timeout_message(method, deadline, limit_s),
                           error_kind="timeout")
        if status == "died":
            log.error("job %s: the solver process died (%s)", task.job_id, value,
                      extra={"job_id": task.job_id})
            return Outcome("failed", error=f"the solver process died ({value})",
                           error_kind="internal")
        try:
            return task.on_result(status, value)
        except Exception as exc:  # noqa: BLE001 - a storage or result error fails this job only
            log.exception("storing the result of job %s failed", task.job_id)
            return Outcome("failed", error=f"internal error storing the result: {exc}",
                           error_kind="internal")
