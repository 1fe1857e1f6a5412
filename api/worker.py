"""What runs inside a solver process: one task in, one message out through a pipe.

A solver process is started once and answers many tasks (the job manager kills and replaces it
to cancel a solve). A task is a plain dict — `{"kind": "plan", "profile", "cluster", "options"}` or
`{"kind": "compare", ..., "methods": [...]}` — and the answer is `(status, value)`:
`("ok", result)`, `("user", message)` for a `PipeplanError` (the request cannot be planned), or
`("internal", message)` for a bug. Nothing here touches the database or HTTP; the job manager
(`api.jobs`) starts these processes and the service (`api.service`) stores what they return.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from typing import Any

from planner.errors import PipeplanError
from planner.formats import Cluster, PlanOptions, Profile


def _make_plan(profile: Profile, cluster: Cluster, options: PlanOptions) -> dict[str, Any]:
    from planner.solve import make_plan  # imported here so this module loads without it

    return make_plan(profile, cluster, options).model_dump(mode="json")


def execute(task: dict[str, Any]) -> Any:
    """Run one task in this process; raises PipeplanError for requests that cannot be planned."""
    profile = Profile.model_validate(task["profile"])
    cluster = Cluster.model_validate(task["cluster"])
    options = PlanOptions.model_validate(task["options"])
    if task["kind"] == "plan":
        return {"plan": _make_plan(profile, cluster, options)}
    if task["kind"] == "compare":
        from planner.solve import compare

        return {"rows": [
            {"method": r.method, "plan": r.plan.model_dump(mode="json")} if r.plan is not None
            else {"method": r.method, "error": r.error}
            for r in compare(profile, cluster, options, task["methods"])
        ]}
    raise ValueError(f"unknown task kind {task['kind']!r}")


def _exit_with_parent() -> None:
    """If the process that started us goes away (the server was killed), stop: an orphaned
    solve would only burn CPU."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def run_one(task: dict[str, Any]) -> tuple[str, Any]:
    """One task -> ("ok", result) | ("user", message) | ("internal", message); never raises."""
    try:
        return "ok", execute(task)
    except PipeplanError as exc:
        return "user", str(exc)
    except Exception as exc:  # noqa: BLE001 - any bug is reported to the parent, not lost
        tail = "".join(traceback.format_exception(exc)[-3:])
        return "internal", f"{type(exc).__name__}: {exc}\n{tail}"


def serve(conn: Any) -> None:
    """Entry point of a solver process: lower priority (HTTP stays responsive), then answer
    tasks from the pipe one at a time until it sends None or closes."""
    _exit_with_parent()
    try:
        os.nice(10)
    except OSError:  # not permitted here; run at normal priority
        pass
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        conn.send(run_one(task))
