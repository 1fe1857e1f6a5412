"""Fixtures for the profiler tests (helpers live in profiler_helpers.py)."""

from __future__ import annotations

import pytest
from profiler_helpers import SMALL_ENV


@pytest.fixture
def small_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Small example sizes for this test's environment (and any subprocess it starts)."""
    for k, v in SMALL_ENV.items():
        monkeypatch.setenv(k, v)
    return dict(SMALL_ENV)
