"""`python -m planner serve`: run the planning service (FastAPI under uvicorn).

Flags override `PIPEPLAN_*` environment variables, which override the safe defaults (loopback
only, `pipeplan.db` SQLite file next to where it runs, no API key). `--workers` is the number of
solver processes; HTTP is served by one uvicorn process (the job queue lives in it).
"""

from __future__ import annotations

import argparse
from typing import Any


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="run the REST API (profiles, plans, timelines)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default=None, help="address to bind (default 127.0.0.1; PIPEPLAN_HOST)")
    p.add_argument("--port", type=int, default=None, help="port (default 8000; PIPEPLAN_PORT)")
    p.add_argument("--db", default=None, help="SQLite file (default pipeplan.db; PIPEPLAN_DB)")
    p.add_argument("--workers", type=int, default=None,
                   help="solver processes running at once (default 2; PIPEPLAN_WORKERS)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--log-format", default=None, choices=["json", "text"],
                   help="log lines as JSON with the request id (default) or plain text (PIPEPLAN_LOG_JSON)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from api.app import create_app
    from api.observe import log_config
    from api.protocol import protocol_class
    from api.settings import Settings
    from planner.errors import PipeplanError
    from planner.io import describe_validation_error, one_or_more_lines

    given = {k: getattr(args, k) for k in ("host", "port", "db", "workers") if getattr(args, k) is not None}
    if getattr(args, "log_format", None) is not None:
        given["log_json"] = args.log_format == "json"
    try:
        settings = Settings(**given)
    except ValidationError as exc:
        raise PipeplanError(f"bad server settings:{one_or_more_lines(describe_validation_error(exc))}") from None
    _check_database(str(settings.db))
    _check_address(settings.host, settings.port)
    if settings.host not in ("127.0.0.1", "localhost", "::1") and not settings.keyed:
        print(f"warning: serving on {settings.host} without an API key; set PIPEPLAN_API_KEY(S)")
    print(f"pipeplan API on http://{settings.host}:{settings.port}  (docs: /docs, database: {settings.db})")
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=args.log_level,
                http=protocol_class(settings.header_timeout_s, settings.body_timeout_s, settings.write_timeout_s),
                log_config=log_config(args.log_level, settings.log_json), access_log=False,
                timeout_graceful_shutdown=5)
    return 0


def _check_address(host: str, port: int) -> None:
    """The address can be listened on, checked before the server starts (else uvicorn logs the
    failure over several lines and exits 3): a port in use, an address that is not this
    machine's or not an address at all."""
    import socket

    from planner.errors import PipeplanError

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise PipeplanError(f"--host {host}: not an address this machine can listen on ({exc}); "
                            "give an address such as 127.0.0.1 or 0.0.0.0") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as exc:
            raise PipeplanError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; "
                                "choose another --port (or stop what listens there) or --host") from None


def _check_database(db: str) -> None:
    """An SQLite file the server can open, checked before it starts (else uvicorn logs the
    error of its startup and exits 3)."""
    import sqlite3
    from pathlib import Path

    from api.storage import DatabaseInUse, Storage, lock_database
    from planner.errors import PipeplanError

    if not db.strip():
        raise PipeplanError("--db is empty; give the SQLite file's name (e.g. pipeplan.db)")
    if db == ":memory:" or db.startswith("file::memory:"):
        raise PipeplanError(f"--db {db}: an in-memory database is not shared between the "
                            "server's threads (each would see an empty one); give a file name, "
                            "e.g. pipeplan.db")
    if "://" in db:
        raise PipeplanError(f"--db {db}: the service stores in an SQLite file, not at a URL; give "
                            "the file's name, e.g. pipeplan.db")
    path = Path(db)
    if path.is_dir():
        raise PipeplanError(f"--db {db}: is a directory; give the SQLite file's name")
    if path.exists() and not path.is_file():  # /dev/zero: SQLite made /dev/zero-journal
        raise PipeplanError(f"--db {db}: is not a regular file (a device, pipe or socket); give "
                            "the SQLite file's name")
    if not path.parent.is_dir():
        raise PipeplanError(f"--db {db}: the folder {path.parent} does not exist; create it first")
    existed = path.exists()
    try:
        held = lock_database(db)
    except DatabaseInUse as exc:
        raise PipeplanError(str(exc)) from None
    except OSError as exc:
        raise PipeplanError(f"--db {db}: cannot create its lock file {exc.filename or db + '.lock'} "
                            f"({exc.strerror or exc}); give a --db in a folder this user can write") from None
    try:  # the service's tables, created now: what the server's start would fail on fails here
        Storage(db).close()
    except sqlite3.OperationalError as exc:  # a disk too small or full, a locked file
        raise PipeplanError(f"--db {db}: cannot create the service's tables ({exc}); check the "
                            "disk's free space and the folder's permissions") from None
    except sqlite3.Error as exc:  # not an SQLite file
        raise PipeplanError(f"--db {db}: cannot be opened as an SQLite database ({exc}); give "
                            "another file, or remove this one if it is not needed") from None
    finally:
        if not existed and path.exists() and path.stat().st_size == 0:
            path.unlink()  # nothing created in it
        if held is not None:
            held.close()  # the server takes it again at its start
