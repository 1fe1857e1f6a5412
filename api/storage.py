"""Persistence for the service: profiles, plans, jobs and rendered timelines in one SQL database.

A small module over the DB-API: plain SQL that SQLite and PostgreSQL both accept (`ON CONFLICT
... DO NOTHING`, no vendor functions), JSON documents in text columns, and one class, `Storage`,
that the rest of the service talks to. SQLite is the default: one connection per thread, WAL
journal (readers never block the writer, several processes may open the same file) and a busy
timeout, so it is safe across threads and processes. To use another database, subclass
`Storage` and override `_connect` and `_setup` (connection and session settings), `PARAM` (the
driver's placeholder, e.g. "%s"), `BEGIN` and `SCHEMA` (e.g. BYTEA for BLOB) — nothing else in
the service touches SQL.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import IO, Any

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS profiles (
        id TEXT PRIMARY KEY,
        sha256 TEXT NOT NULL UNIQUE,
        model_path TEXT NOT NULL,
        num_layers INTEGER NOT NULL,
        created_at TEXT NOT NULL,
        body TEXT NOT NULL,
        owner TEXT NOT NULL DEFAULT '',
        size_bytes INTEGER NOT NULL DEFAULT 0)""",
    """CREATE TABLE IF NOT EXISTS plans (
        id TEXT PRIMARY KEY,
        cache_key TEXT NOT NULL UNIQUE,
        profile_id TEXT NOT NULL,
        method TEXT NOT NULL,
        iteration_ms REAL,
        created_at TEXT NOT NULL,
        meta TEXT NOT NULL,
        body TEXT NOT NULL,
        owner TEXT NOT NULL DEFAULT '',
        size_bytes INTEGER NOT NULL DEFAULT 0)""",
    "CREATE INDEX IF NOT EXISTS plans_by_profile ON plans (profile_id, created_at)",
    """CREATE TABLE IF NOT EXISTS jobs (
        id TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        status TEXT NOT NULL,
        cache_key TEXT NOT NULL,
        profile_id TEXT NOT NULL,
        request TEXT NOT NULL,
        plan_id TEXT,
        result TEXT,
        error TEXT,
        error_kind TEXT,
        created_at TEXT NOT NULL,
        started_at TEXT,
        finished_at TEXT,
        owner TEXT NOT NULL DEFAULT '')""",
    "CREATE INDEX IF NOT EXISTS jobs_by_status ON jobs (status)",
    """CREATE TABLE IF NOT EXISTS renders (
        plan_id TEXT NOT NULL,
        kind TEXT NOT NULL,
        body BLOB NOT NULL,
        created_at TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (plan_id, kind))""",
    "CREATE INDEX IF NOT EXISTS jobs_by_created ON jobs (created_at)",
    "CREATE INDEX IF NOT EXISTS renders_by_created ON renders (created_at)",
]

# columns added after the first release: (table, column, definition) for older databases
MIGRATIONS = [
    ("profiles", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("profiles", "size_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("plans", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("plans", "size_bytes", "INTEGER NOT NULL DEFAULT 0"),
    ("jobs", "owner", "TEXT NOT NULL DEFAULT ''"),
    ("renders", "created_at", "TEXT NOT NULL DEFAULT ''"),
]

UNFINISHED = ("queued", "running")


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class ProfileRow:
    id: str
    sha256: str
    model_path: str
    num_layers: int
    created_at: str
    body: dict[str, Any] | None = None  # None in listings


@dataclass(frozen=True)
class PlanRow:
    id: str
    cache_key: str
    profile_id: str
    method: str
    iteration_ms: float | None
    created_at: str
    meta: dict[str, Any]
    body: dict[str, Any] | None = None  # None in listings


@dataclass(frozen=True)
class JobRow:
    id: str
    kind: str  # "plan" | "compare"
    status: str  # queued | running | succeeded | failed | cancelled
    cache_key: str
    profile_id: str
    request: dict[str, Any]
    plan_id: str | None
    result: Any
    error: str | None
    error_kind: str | None  # "user" (the request cannot be planned) | "internal" | "lost" | "timeout"
    created_at: str
    started_at: str | None
    finished_at: str | None


class _Cursor:
    """A DB-API cursor that writes statements with `?` placeholders in the driver's style."""

    def __init__(self, cur: Any, param: str) -> None:
        self._cur, self._param = cur, param

    def execute(self, sql: str, params: tuple[Any, ...] = ()) -> _Cursor:
        self._cur.execute(sql if self._param == "?" else sql.replace("?", self._param), params)
        return self

    def fetchall(self) -> list[tuple[Any, ...]]:
        return self._cur.fetchall()

    @property
    def rowcount(self) -> int:
        return self._cur.rowcount


class DatabaseInUse(RuntimeError):
    """Another live server holds the database (`lock_database`)."""


class DatabaseReplaced(sqlite3.OperationalError):
    """The database file was deleted or replaced under a running server (`Storage.check_same_file`):
    the server cannot use it now (answered 503, as a full disk is)."""


class DatabaseLock:
    """The locks `lock_database` took; `close()` releases them (and removes the inode's lock
    file, which nobody else can hold while this lock does)."""

    def __init__(self, files: list[IO[str]], remove: str | None = None) -> None:
        self.files, self.remove = files, remove

    def close(self) -> None:
        if self.remove is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.remove)
            self.remove = None
        for f in self.files:
            f.close()


def _flock(f: IO[str]) -> bool:
    import fcntl

    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True


def _holder(f: IO[str]) -> str:
    f.seek(0)
    return f.read().strip()[:20] or "?"


def _mark(f: IO[str]) -> None:
    if f.writable():
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()


def _inode_lock(folder: str, st: os.stat_result) -> tuple[IO[str] | None, str, bool]:
    """Lock the database's inode: a hidden lock file named by it in the database's own folder,
    the same for every name the file has there (hard links). Returns (the file, its name,
    whether locked: False when another server holds it, the file then being open to read its
    pid); (None, name, True) where none can be made (not a regular file there, no room). Never
    follows a symbolic link. The file is removed when the lock is released, so the lock taken
    counts only while the name still leads to the locked file."""
    import stat

    name = os.path.join(folder, f".pipeplan-db-{st.st_dev}-{st.st_ino}.lock")
    for _ in range(10):
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            continue
        except OSError:  # a link or a folder in its place, a read-only folder: no inode lock
            return None, name, True
        f = os.fdopen(fd, "r+", encoding="utf-8")
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            f.close()
            return None, name, True
        if not _flock(f):
            return f, name, False
        try:
            same = os.stat(name, follow_symlinks=False).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return f, name, True
        f.close()  # removed by the server that released it after this opened it: again
    return None, name, True


def lock_database(path: str) -> DatabaseLock | None:
    """Take the server's exclusive lock on the database `path` for as long as the returned locks
    are not closed (released when they are, or when the process dies, kill -9 included). A
    server marks the jobs it finds unfinished at its start as lost: a second server on the same
    file would do that to the first one's live jobs. Raises DatabaseInUse, naming the holder's
    pid. Two locks, neither on the database itself (closing any descriptor of the database
    would drop SQLite's own POSIX locks in this process): `<db>.lock` beside the file the path
    resolves to (a symbolic link and its target share it), and a lock of its inode in the same
    folder (a hard link there shares that one; so does a server whose `<db>.lock` was deleted;
    a hard link in another folder is not seen); the file is created empty if it does not exist.
    None where the platform has no flock (Windows)."""
    try:
        import fcntl  # noqa: F401 - only to learn whether flock exists
    except ImportError:  # pragma: no cover - not on Linux or macOS
        return None
    real = os.path.realpath(path)
    beside = open(real + ".lock", "a+", encoding="utf-8")  # noqa: SIM115 - held open while serving
    if not _flock(beside):
        holder = _holder(beside)
        beside.close()
        raise DatabaseInUse(f"another pipeplan server (pid {holder}) is using the database "
                            f"{path}; stop that server first, or give this one another --db")
    try:
        return _lock_inode(path, real, beside)
    except BaseException:
        beside.close()
        raise


def _lock_inode(path: str, real: str, beside: IO[str]) -> DatabaseLock:
    """`lock_database` once `<db>.lock` is held: the inode's lock, then both marked."""
    try:  # an empty file is an empty SQLite database; made now, its inode is locked from the start
        os.close(os.open(real, os.O_RDONLY | os.O_CREAT, 0o644))
        st = os.stat(real)
    except OSError:  # SQLite will say what is wrong with it
        st = None
    files, remove = [beside], None
    if st is not None:
        inode, name, locked = _inode_lock(os.path.dirname(real), st)
        if not locked:
            assert inode is not None
            holder = _holder(inode)
            inode.close()
            raise DatabaseInUse(
                f"another pipeplan server (pid {holder}) is using the database {path} under "
                "another name (a hard link to the same file); stop that server first, or give "
                "this one another --db")
        if inode is not None:
            _mark(inode)
            files.append(inode)
            remove = name
    _mark(beside)
    return DatabaseLock(files, remove)


class Storage:
    """Every read and write of the service. Thread-safe: one connection per thread."""

    PARAM = "?"
    BEGIN = "BEGIN IMMEDIATE"  # take the write lock at once: two writers never deadlock on an upgrade
    SCHEMA = SCHEMA
    BUSY_MS = 30_000  # a query waits this long for another connection's write lock

    def __init__(self, url: str) -> None:
        self.url = url
        self._local = threading.local()
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._file: tuple[int, int] | None = None  # set once the tables are made
        with self._tx() as cur:
            for stmt in self.SCHEMA:
                if stmt.startswith("CREATE TABLE"):
                    cur.execute(stmt)
            self._migrate(cur)
            for stmt in self.SCHEMA:
                if not stmt.startswith("CREATE TABLE"):
                    cur.execute(stmt)
        self._file = self._identity()

    def _identity(self) -> tuple[int, int] | None:
        """The database file's (device, inode); None for a database that is not a file."""
        try:
            st = os.stat(self.url)
        except (OSError, ValueError):
            return None
        return st.st_dev, st.st_ino

    def check_same_file(self) -> None:
        """Raise DatabaseReplaced if the file at the database's path is no longer the one this
        server opened: deleted (a new connection would create an empty one there) or replaced.
        Threads that opened it before would go on with the old file, new ones with the new."""
        if self._file is None:
            return
        now = self._identity()
        if now != self._file:
            what = "deleted" if now is None else "replaced by another file"
            raise DatabaseReplaced(f"the database file {self.url} was {what} while the server ran; "
                                   "restore it and restart the server")

    def _migrate(self, cur: _Cursor) -> None:
        """Add the columns a database written by an older server lacks (SQLite's table_info;
        another database overrides this)."""
        for table, column, definition in MIGRATIONS:
            have = {r[1] for r in cur.execute(f"PRAGMA table_info({table})").fetchall()}
            if column not in have:
                cur.execute(f"ALTER TABLE {table} ADD COLUMN {column} {definition}")

    # ------------------------------------------------------------ connections
    def _connect(self) -> Any:
        self.check_same_file()  # else sqlite3 makes a new, empty file where the database was
        conn = sqlite3.connect(self.url, timeout=self.BUSY_MS / 1e3, isolation_level=None, check_same_thread=False)
        self._setup(conn)
        return conn

    def _setup(self, conn: Any) -> None:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={self.BUSY_MS}")
        conn.execute("PRAGMA foreign_keys=ON")

    def _conn(self) -> Any:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._connect()
            self._local.conn = conn
            with self._lock:
                self._all.append(conn)
        return conn

    @contextmanager
    def _tx(self) -> Iterator[_Cursor]:
        """A write transaction (not into a file that replaced the server's database)."""
        self.check_same_file()
        cur = _Cursor(self._conn().cursor(), self.PARAM)
        cur.execute(self.BEGIN)
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return _Cursor(self._conn().cursor(), self.PARAM).execute(sql, params).fetchall()

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                try:
                    conn.close()
                except Exception:  # noqa: BLE001 - closing a connection of a finished thread
                    pass
            self._all.clear()
        self._local = threading.local()

    def ping(self) -> bool:
        return self._query("SELECT 1") == [(1,)]

    READY_BUSY_MS = 1000  # a readiness probe waits this long for another process's write lock

    def writable(self) -> bool:
        """Whether the service can use its database now: the file is the one the server opened,
        holds the service's tables, and takes a write transaction within READY_BUSY_MS (a probe
        that waited the queries' 30 s held a thread of the server's pool for as long)."""
        conn = self._conn()  # (it and `_tx` check the file is the one opened)
        conn.execute(f"PRAGMA busy_timeout={self.READY_BUSY_MS}")
        try:
            with self._tx() as cur:
                cur.execute("SELECT 1 FROM jobs LIMIT 1")  # "no such table" in a new, empty file
                cur.execute("CREATE TABLE IF NOT EXISTS ready_probe (x INTEGER)")
                cur.execute("DELETE FROM ready_probe")
        finally:
            conn.execute(f"PRAGMA busy_timeout={self.BUSY_MS}")
        return True

    def stored_bytes(self, owner: str) -> int:
        """Bytes of profiles and plans stored by `owner` (what its quota counts)."""
        rows = self._query(
            "SELECT (SELECT COALESCE(SUM(size_bytes), 0) FROM profiles WHERE owner = ?) + "
            "(SELECT COALESCE(SUM(size_bytes), 0) FROM plans WHERE owner = ?)", (owner, owner))
        return int(rows[0][0])

    # ------------------------------------------------------------ profiles
    def put_profile(self, sha256: str, model_path: str, num_layers: int, body: dict[str, Any],
                    owner: str = "") -> tuple[ProfileRow, bool]:
        """Store a profile unless one with the same sha256 exists; returns (row, created)."""
        pid = new_id()
        text = json.dumps(body)
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO profiles (id, sha256, model_path, num_layers, created_at, body, owner, "
                "size_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (sha256) DO NOTHING",
                (pid, sha256, model_path, num_layers, now(), text, owner, len(text)),
            )
            created = cur.rowcount == 1
        row = self.get_profile_by_sha(sha256)
        assert row is not None
        return row, created

    def _profile(self, r: tuple[Any, ...], with_body: bool) -> ProfileRow:
        return ProfileRow(r[0], r[1], r[2], r[3], r[4], json.loads(r[5]) if with_body else None)

    def get_profile(self, profile_id: str) -> ProfileRow | None:
        rows = self._query(
            "SELECT id, sha256, model_path, num_layers, created_at, body FROM profiles WHERE id = ?",
            (profile_id,),
        )
        return self._profile(rows[0], True) if rows else None

    def get_profile_by_sha(self, sha256: str) -> ProfileRow | None:
        rows = self._query(
            "SELECT id, sha256, model_path, num_layers, created_at, body FROM profiles WHERE sha256 = ?",
            (sha256,),
        )
        return self._profile(rows[0], True) if rows else None

    def list_profiles(self, limit: int, offset: int) -> tuple[list[ProfileRow], int]:
        total = self._query("SELECT COUNT(*) FROM profiles")[0][0]
        rows = self._query(
            "SELECT id, sha256, model_path, num_layers, created_at, '' FROM profiles "
            "ORDER BY created_at, id LIMIT ? OFFSET ?",
            (limit, offset),
        )
        return [self._profile(r, False) for r in rows], total

    def delete_profile(self, profile_id: str) -> bool | None:
        """Delete a profile with its plans and their renders; None if a job still queued or
        running uses it (nothing deleted), False if there is no such profile."""
        with self._tx() as cur:
            if cur.execute("SELECT 1 FROM jobs WHERE profile_id = ? AND status IN ('queued', 'running')",
                           (profile_id,)).fetchall():
                return None
            cur.execute("DELETE FROM renders WHERE plan_id IN (SELECT id FROM plans WHERE profile_id = ?)",
                        (profile_id,))
            cur.execute("DELETE FROM plans WHERE profile_id = ?", (profile_id,))
            cur.execute("DELETE FROM profiles WHERE id = ?", (profile_id,))
            return cur.rowcount == 1

    # ------------------------------------------------------------ plans
    _PLAN_COLS = "id, cache_key, profile_id, method, iteration_ms, created_at, meta"

    def _plan(self, r: tuple[Any, ...]) -> PlanRow:
        body = json.loads(r[7]) if len(r) > 7 else None
        return PlanRow(r[0], r[1], r[2], r[3], r[4], r[5], json.loads(r[6]), body)

    def put_plan(self, cache_key: str, profile_id: str, method: str, body: dict[str, Any],
                 meta: dict[str, Any], owner: str = "") -> PlanRow | None:
        """Store a plan under its cache key; if the key is taken, keep and return the first.
        None, and nothing stored, where its profile is gone (deleted while the plan was made:
        a plan is never kept without its profile, which `delete_profile` promises)."""
        iteration_ms = (body.get("predicted") or {}).get("iteration_ms")
        text = json.dumps(body)
        with self._tx() as cur:
            if not cur.execute("SELECT 1 FROM profiles WHERE id = ?", (profile_id,)).fetchall():
                return None
            cur.execute(
                f"INSERT INTO plans ({self._PLAN_COLS}, body, owner, size_bytes) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (cache_key) DO NOTHING",
                (new_id(), cache_key, profile_id, method, iteration_ms, now(), json.dumps(meta), text,
                 owner, len(text)),
            )
        row = self.get_plan_by_key(cache_key)
        assert row is not None
        return row

    def get_plan(self, plan_id: str) -> PlanRow | None:
        rows = self._query(f"SELECT {self._PLAN_COLS}, body FROM plans WHERE id = ?", (plan_id,))
        return self._plan(rows[0]) if rows else None

    def plan_exists(self, plan_id: str) -> bool:
        return bool(self._query("SELECT 1 FROM plans WHERE id = ?", (plan_id,)))

    def get_plan_by_key(self, cache_key: str) -> PlanRow | None:
        rows = self._query(f"SELECT {self._PLAN_COLS}, body FROM plans WHERE cache_key = ?", (cache_key,))
        return self._plan(rows[0]) if rows else None

    def list_plans(self, limit: int, offset: int, profile_id: str | None = None) -> tuple[list[PlanRow], int]:
        where, params = ("WHERE profile_id = ?", (profile_id,)) if profile_id else ("", ())
        total = self._query(f"SELECT COUNT(*) FROM plans {where}", params)[0][0]
        rows = self._query(
            f"SELECT {self._PLAN_COLS} FROM plans {where} ORDER BY created_at, id LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        return [self._plan(r) for r in rows], total

    def delete_plan(self, plan_id: str) -> bool:
        with self._tx() as cur:
            cur.execute("DELETE FROM renders WHERE plan_id = ?", (plan_id,))
            cur.execute("DELETE FROM plans WHERE id = ?", (plan_id,))
            return cur.rowcount == 1

    # ------------------------------------------------------------ rendered timelines
    def get_render(self, plan_id: str, kind: str) -> bytes | None:
        rows = self._query("SELECT body FROM renders WHERE plan_id = ? AND kind = ?", (plan_id, kind))
        return bytes(rows[0][0]) if rows else None

    def put_render(self, plan_id: str, kind: str, body: bytes) -> None:
        with self._tx() as cur:
            if cur.execute("SELECT 1 FROM plans WHERE id = ?", (plan_id,)).fetchall():
                cur.execute(
                    "INSERT INTO renders (plan_id, kind, body, created_at) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (plan_id, kind) DO NOTHING",
                    (plan_id, kind, body, now()),
                )

    # ------------------------------------------------------------ jobs
    _JOB_COLS = ("id, kind, status, cache_key, profile_id, request, plan_id, result, error, "
                 "error_kind, created_at, started_at, finished_at")

    def _job(self, r: tuple[Any, ...]) -> JobRow:
        return JobRow(
            r[0], r[1], r[2], r[3], r[4], json.loads(r[5]), r[6],
            json.loads(r[7]) if r[7] is not None else None, *r[8:],
        )

    def create_job(self, kind: str, cache_key: str, profile_id: str, request: dict[str, Any],
                   owner: str = "") -> JobRow:
        jid = new_id()
        with self._tx() as cur:
            cur.execute(
                "INSERT INTO jobs (id, kind, status, cache_key, profile_id, request, created_at, owner) "
                "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?)",
                (jid, kind, cache_key, profile_id, json.dumps(request), now(), owner),
            )
        job = self.get_job(jid)
        assert job is not None
        return job

    def get_job(self, job_id: str) -> JobRow | None:
        rows = self._query(f"SELECT {self._JOB_COLS} FROM jobs WHERE id = ?", (job_id,))
        return self._job(rows[0]) if rows else None

    def list_jobs(self, limit: int, offset: int, status: str | None = None) -> tuple[list[JobRow], int]:
        """Jobs newest first, optionally only those with `status`."""
        where, params = ("WHERE status = ?", (status,)) if status else ("", ())
        total = self._query(f"SELECT COUNT(*) FROM jobs {where}", params)[0][0]
        rows = self._query(
            f"SELECT {self._JOB_COLS} FROM jobs {where} ORDER BY created_at DESC, id DESC LIMIT ? OFFSET ?",
            (*params, limit, offset),
        )
        return [self._job(r) for r in rows], total

    def delete_job(self, job_id: str) -> bool:
        """Delete a finished job's record; False if it is unknown or still unfinished."""
        with self._tx() as cur:
            cur.execute("DELETE FROM jobs WHERE id = ? AND status NOT IN ('queued', 'running')", (job_id,))
            return cur.rowcount == 1

    def prune(self, keep_jobs: int, keep_jobs_s: float, keep_renders: int, keep_renders_s: float,
              at: datetime | None = None) -> dict[str, int]:
        """Retention: delete finished jobs and rendered timelines beyond the newest `keep_*` or
        older than `keep_*_s` seconds (0 = no limit). Returns how many of each were deleted."""
        at = at or datetime.now(UTC)
        deleted = {"jobs": 0, "renders": 0}
        with self._tx() as cur:
            if keep_jobs_s > 0:
                cutoff = (at - timedelta(seconds=keep_jobs_s)).isoformat(timespec="milliseconds")
                deleted["jobs"] += cur.execute(
                    "DELETE FROM jobs WHERE status NOT IN ('queued', 'running') AND created_at < ?",
                    (cutoff,)).rowcount
            if keep_jobs > 0:
                deleted["jobs"] += cur.execute(
                    "DELETE FROM jobs WHERE status NOT IN ('queued', 'running') AND id NOT IN "
                    "(SELECT id FROM jobs WHERE status NOT IN ('queued', 'running') "
                    "ORDER BY created_at DESC, id DESC LIMIT ?)", (keep_jobs,)).rowcount
            if keep_renders_s > 0:
                cutoff = (at - timedelta(seconds=keep_renders_s)).isoformat(timespec="milliseconds")
                deleted["renders"] += cur.execute(
                    "DELETE FROM renders WHERE created_at < ?", (cutoff,)).rowcount
            if keep_renders > 0:
                deleted["renders"] += cur.execute(
                    "DELETE FROM renders WHERE (plan_id, kind) NOT IN (SELECT plan_id, kind FROM "
                    "renders ORDER BY created_at DESC LIMIT ?)", (keep_renders,)).rowcount
        return deleted

    def mark_running(self, job_id: str) -> bool:
        """queued -> running; False if the job is no longer queued (cancelled meanwhile)."""
        with self._tx() as cur:
            cur.execute(
                "UPDATE jobs SET status = 'running', started_at = ? WHERE id = ? AND status = 'queued'",
                (now(), job_id),
            )
            return cur.rowcount == 1

    def finish_job(self, job_id: str, status: str, *, plan_id: str | None = None, result: Any = None,
                   error: str | None = None, error_kind: str | None = None) -> bool:
        """Move an unfinished job to its final status; False if it had already finished."""
        with self._tx() as cur:
            cur.execute(
                "UPDATE jobs SET status = ?, plan_id = ?, result = ?, error = ?, error_kind = ?, "
                "finished_at = ? WHERE id = ? AND status IN ('queued', 'running')",
                (status, plan_id, None if result is None else json.dumps(result), error, error_kind,
                 now(), job_id),
            )
            return cur.rowcount == 1

    def fail_unfinished_jobs(self, reason: str) -> int:
        """At startup: jobs a previous server left queued or running are reported failed."""
        with self._tx() as cur:
            cur.execute(
                "UPDATE jobs SET status = 'failed', error = ?, error_kind = 'lost', finished_at = ? "
                "WHERE status IN ('queued', 'running')",
                (reason, now()),
            )
            return cur.rowcount
