"""Settings: safe defaults, PIPEPLAN_* environment variables, and the serve command's flags."""

from __future__ import annotations

import argparse

import pytest

from api.settings import Settings
from planner.cli import build_parser


def test_defaults_are_safe(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HOST", "PORT", "DB", "API_KEY", "WORKERS"):
        monkeypatch.delenv(f"PIPEPLAN_{name}", raising=False)
    s = Settings()
    assert s.host == "127.0.0.1" and s.db == "pipeplan.db" and s.api_key is None


def test_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"PIPEPLAN_DB": "/tmp/x.db", "PIPEPLAN_API_KEY": "s3cret-key", "PIPEPLAN_MAX_BODY_BYTES": "123",
           "PIPEPLAN_MAX_TIME_LIMIT_S": "7.5", "PIPEPLAN_WORKERS": "3", "PIPEPLAN_QUEUE_SIZE": "9",
           "PIPEPLAN_SYNC_WAIT_S": "0.25"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert (s.db, s.api_key_value(), s.max_body_bytes, s.max_time_limit_s, s.workers, s.queue_size,
            s.sync_wait_s) == ("/tmp/x.db", "s3cret-key", 123, 7.5, 3, 9, 0.25)
    assert "s3cret" not in repr(s)  # the key is a secret
    assert Settings(workers=1).workers == 1  # explicit values win over the environment


def test_serve_flags() -> None:
    args = build_parser().parse_args(["serve", "--port", "9001", "--db", "p.db", "--workers", "4"])
    assert isinstance(args, argparse.Namespace)
    assert (args.host, args.port, args.db, args.workers) == (None, 9001, "p.db", 4)
    assert args.func.__module__ == "planner.commands.serve"
