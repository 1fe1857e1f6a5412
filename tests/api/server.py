"""Start and stop a real `python -m planner serve` on 127.0.0.1 (a free port) for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, db: Path, port: int | None = None, workers: int = 2, **env: str) -> None:
        self.db, self.port, self.workers = db, port or free_port(), workers
        self.env = {**os.environ, **{f"PIPEPLAN_{k.upper()}": str(v) for k, v in env.items()}}
        if "api_key" not in env:
            self.env.pop("PIPEPLAN_API_KEY", None)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> Server:
        cmd = [sys.executable, "-m", "planner", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--db", str(self.db), "--workers", str(self.workers), "--log-level", "warning"]
        self.log = self.db.parent / f"server-{self.port}.log"  # a file: a full pipe would block it
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.stop()
