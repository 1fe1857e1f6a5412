"""What runs inside a worker process: one task in, one message out through a pipe.

A worker process is started once and answers many tasks (the server kills and replaces it to
cancel a solve or stop one past its deadline). A task is a plain dict — `{"kind": "plan",
"profile", "cluster", "options"}` or `{"kind": "render", "plan", "format", "title",
"max_events"}` — and the answer is `(status, value)`: `("ok", result)`, `("user", message)` for a
`PipeplanError` (the request cannot be served), or `("internal", message)` for a bug. Nothing
here touches the database or HTTP.

The worker exits as soon as the server is gone: a thread blocks on the lifeline pipe (its write
end lives only in the server, so it reads EOF when the server dies however it died), and another
watches the parent process id.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any

from api.wording import in_api_words
from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile

log = logging.getLogger(__name__)


def _make_plan(task: dict[str, Any]) -> dict[str, Any]:
    from planner.solve import make_plan  # imported here so this module loads without it

    profile = Profile.model_validate(task["profile"])
    cluster = Cluster.model_validate(task["cluster"])
    options = PlanOptions.model_validate(task["options"])
    # the search runs as on the command line (its budget is work: the same plan for the same
    # input); the job manager stops it only past the search's own wall-clock net
    return {"plan": make_plan(profile, cluster, options).model_dump(mode="json")}


def _render(task: dict[str, Any]) -> bytes:
    import json

    from api import timeline
    from planner.formats import Plan
    from planner.trace import chrome_trace

    plan = Plan.model_validate(task["plan"])
    try:
        sim = timeline.simulate_plan(plan, task["max_events"])
    except timeline.TooLarge as exc:
        raise PipeplanError(str(exc)) from None
    if task["format"] == "trace":
        return json.dumps(chrome_trace(sim)).encode()
    return timeline.render(sim, task["format"], title=task.get("title", ""))


def execute(task: dict[str, Any]) -> Any:
    """Run one task in this process; raises PipeplanError for requests that cannot be served."""
    if task["kind"] == "plan":
        return _make_plan(task)
    if task["kind"] == "render":
        return _render(task)
    raise ValueError(f"unknown task kind {task['kind']!r}")


def _exit_with_server(lifeline: Any) -> None:
    """Stop this process when the server goes away (an orphaned solve would only burn CPU)."""
    parent = os.getppid()

    def watch_pipe() -> None:
        try:
            lifeline.recv()  # the server never sends: this returns only by EOF (server gone)
        except (EOFError, OSError):
            pass
        os._exit(3)

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    if lifeline is not None:
        threading.Thread(target=watch_pipe, daemon=True, name="lifeline").start()
    threading.Thread(target=watch_parent, daemon=True, name="parent-watch").start()


def limit_memory(extra_bytes: int) -> None:
    """Let this process's address space grow by at most `extra_bytes` beyond its size now (0:
    no limit): a solve of a huge manual plan (4096 stages, GPipe, 4096 microbatches) grew one
    worker to 5 GB before its time limit (an outside review), and each worker can run one."""
    if extra_bytes <= 0:
        return
    import resource

    try:
        with open("/proc/self/status") as f:
            size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + extra_bytes
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError, StopIteration):  # not Linux, or not allowed: no limit
        return


def out_of_memory(memory_mb: int) -> tuple[str, str]:
    """The answer to a task that ran past the memory limit (`limit_memory`)."""
    return "user", (f"this request needs more memory than a worker of this server may take "
                    f"({memory_mb} MB, PIPEPLAN_WORKER_MEMORY_MB): plan a smaller problem "
                    "(fewer stages, devices or microbatches) or raise that limit")


def run_one(task: dict[str, Any], memory_mb: int = 0) -> tuple[str, Any]:
    """One task -> ("ok", result) | ("user", message) | ("internal", message); never raises.
    A MemoryError is the user's message "needs more memory" (`memory_mb`: the limit)."""
    try:
        return "ok", execute(task)
    except PipeplanError as exc:
        return "user", in_api_words(str(exc))
    except MemoryError:
        return out_of_memory(memory_mb)
    except Exception as exc:  # noqa: BLE001 - any bug is reported to the parent, not lost
        # the traceback goes to the server's log (this process's stderr), not to the client
        log.error("internal error in a %s task:\n%s", task.get("kind", "?"),
                  "".join(traceback.format_exception(exc)))
        return "internal", (f"internal error ({type(exc).__name__}) in the planner; the server "
                            "logged its traceback")


def serve(conn: Any, lifeline: Any = None, memory_mb: int = 0) -> None:
    """Entry point of a worker process: lower priority (HTTP stays responsive), its memory
    limited (`limit_memory`), then answer tasks from the pipe one at a time until it sends None
    or closes. After a task that ran out of memory it exits (the server starts another):
    whatever failed to allocate may have left state half made."""
    _exit_with_server(lifeline)
    try:
        os.nice(10)
    except OSError:  # not permitted here; run at normal priority
        pass
    limit_memory(memory_mb * 2**20)
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        answer = run_one(task, memory_mb)
        conn.send(answer)
        if answer == out_of_memory(memory_mb):
            return
