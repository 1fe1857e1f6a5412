"""The storage module: first writer wins on a cache key or a profile hash, and several threads
and processes writing the same SQLite file at once lose nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from api.storage import Storage

WRITER = """
import sys
from api.storage import Storage
s = Storage(sys.argv[1])
for i in range(40):
    row, _ = s.put_profile(f"{sys.argv[2]}-{i}", "m.py", 1, {"i": i})
    assert s.put_plan(f"key-{i % 10}", row.id, "blocks", {"predicted": {"iteration_ms": float(i)}}, {})
"""


def test_first_writer_wins(tmp_path: Path) -> None:
    s = Storage(str(tmp_path / "db.sqlite"))
    a, created_a = s.put_profile("sha", "a.py", 3, {"x": 1})
    b, created_b = s.put_profile("sha", "b.py", 4, {"x": 2})
    assert created_a and not created_b and a == b and b.body == {"x": 1}
    p = s.put_plan("k", a.id, "blocks", {"predicted": {"iteration_ms": 1.5}}, {})
    q = s.put_plan("k", a.id, "uniform", {"predicted": {"iteration_ms": 9.0}}, {})
    assert p == q and q.method == "blocks" and q.iteration_ms == 1.5
    job = s.create_job("plan", "k", a.id, {})
    assert s.mark_running(job.id) and not s.mark_running(job.id)
    assert s.finish_job(job.id, "succeeded", plan_id=p.id)
    assert not s.finish_job(job.id, "cancelled")  # a finished job stays finished
    assert s.get_job(job.id).status == "succeeded"
    assert s.fail_unfinished_jobs("gone") == 0


def test_threads_and_processes_share_one_file(tmp_path: Path) -> None:
    db = str(tmp_path / "db.sqlite")
    s = Storage(db)
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, db, f"proc{k}"]) for k in range(2)]

    def write(tag: str) -> None:
        for i in range(40):
            s.put_profile(f"{tag}-{i}", "m.py", 1, {"i": i})

    threads = [threading.Thread(target=write, args=(f"thread{k}",)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [p.wait(120) for p in procs] == [0, 0]
    assert s.list_profiles(1, 0)[1] == 5 * 40
    plans, total = s.list_plans(100, 0)
    assert total == 10 and sorted(p.cache_key for p in plans) == sorted(f"key-{i}" for i in range(10))


def test_a_plan_is_never_kept_without_its_profile(tmp_path: Path) -> None:
    """A profile deleted while its plan was being made (the plan request read it, then a DELETE
    ran): the plan is not stored, so no listing or cache lookup finds a plan whose profile is
    gone."""
    s = Storage(str(tmp_path / "db.sqlite"))
    a, _ = s.put_profile("sha", "a.py", 3, {"x": 1})
    assert s.delete_profile(a.id)
    assert s.put_plan("k", a.id, "blocks", {"predicted": {"iteration_ms": 1.5}}, {}) is None
    assert s.get_plan_by_key("k") is None and s.list_plans(10, 0, a.id)[1] == 0
