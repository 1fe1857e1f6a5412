"""schemathesis against a live server on 127.0.0.1 (`python -m planner serve`): every check
(server errors, status codes, content types, headers, response schemas, negative data rejected,
positive data accepted, unsupported methods, auth, use after delete, ...) and every phase
(examples, coverage, fuzzing, stateful through the schema's links), bounded to a few seconds.
Run once without API keys and once with two keys (the schema then marks the Bearer security).

The solver is real; the server's caps keep generated plans small (1 s time limit, 64 layers,
64 devices). tests/api/schemathesis.toml lists the documented 4xx a schema-valid request may
still get (422: a layer graph out of order, a plan that does not fit in memory, ...).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.server import Server

HERE = Path(__file__).resolve().parent
LIMITS = {"max_time_limit_s": "1", "max_layers": "64", "max_devices": "64", "max_microbatches": "64",
          "queue_size": "1000", "sync_wait_s": "0.5"}


@pytest.mark.parametrize("keyed", [False, True], ids=["open", "api-keys"])
def test_schemathesis_all_checks_live_server(tmp_path: Path, keyed: bool) -> None:
    env = {**LIMITS, **({"api_keys": "ci:s3cret-ci,other:s3cret-2"} if keyed else {})}
    with Server(tmp_path / "pipeplan.db", **env) as server:
        cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(HERE / "schemathesis.toml"),
               "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", "25",
               # one worker: with two threads, hypothesis's ast.parse of its lambdas hit CPython
               # 3.11's "AST constructor recursion depth mismatch" (SystemError) in one CI run
               "--workers", "1", "--request-timeout", "30", "--seed", "14", "--no-color"]
        if keyed:
            cmd += ["-H", "Authorization: Bearer s3cret-ci"]
        out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        log = server.log.read_text()
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-6000:]
    for phase in ("Examples", "Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in report, report[-3000:]
    assert " passed" in report and "failed" not in report.split("SUMMARY")[-1]
    assert "Traceback" not in log, log[-3000:]
