"""schemathesis against the app's own OpenAPI schema: no generated request gets a 5xx, and
responses match the documented schemas. Examples are bounded so this stays well under a minute.

Plans are solved for real (worker processes); the server's time limit cap is 1 s here, so a
generated request that asks for a long solve is clamped rather than slowing the test down.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from pathlib import Path

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from api.app import create_app
from tests.api.conftest import make_settings

_DB_DIR = Path(tempfile.mkdtemp(prefix="pipeplan-fuzz-"))
atexit.register(shutil.rmtree, _DB_DIR, ignore_errors=True)  # after schemathesis stops the app
APP = create_app(make_settings(_DB_DIR, workers=2, queue_size=1000, sync_wait_s=0.5,
                               max_time_limit_s=1.0, max_layers=64, max_devices=64,
                               max_microbatches=64))
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: schemathesis.Case) -> None:
    case.call_and_validate(checks=[not_a_server_error])
