"""Service settings: from keyword arguments, else `PIPEPLAN_*` environment variables, else safe
defaults (loopback only, an embedded SQLite file, no API key, small limits)."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", extra="ignore")

    host: str = "127.0.0.1"  # loopback only unless asked otherwise
    port: int = Field(default=8000, ge=0, le=65535)
    db: str = "pipeplan.db"  # SQLite file (":memory:" is not shared across threads; use a file)
    api_key: SecretStr | None = None  # set => `Authorization: Bearer <key>` on every route but /healthz

    workers: int = Field(default=2, ge=1, le=64)  # solver processes running at once
    queue_size: int = Field(default=32, ge=0, le=10_000)  # solves waiting for a worker
    sync_wait_s: float = Field(default=2.0, ge=0)  # POST /v1/plans waits this long before 202
    retry_after_s: int = Field(default=5, ge=1)  # Retry-After on 503 (queue full)
    max_time_limit_s: float = Field(default=60.0, gt=0)  # solver time limits are clamped to this
    solve_grace_s: float = Field(default=30.0, ge=0)  # a worker past time limit + grace is killed

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)  # larger bodies get 413
    max_layers: int = Field(default=5_000, ge=1)
    max_devices: int = Field(default=4_096, ge=1)
    max_microbatches: int = Field(default=4_096, ge=1)
    max_compare_methods: int = Field(default=8, ge=1)
    timeline_max_events: int = Field(default=20_000, ge=1)  # larger schedules: 422 for the pictures
    trace_max_events: int = Field(default=200_000, ge=1)  # and for trace.json

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None
