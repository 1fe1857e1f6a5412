"""Service settings: from keyword arguments, else `PIPEPLAN_*` environment variables, else safe
defaults (loopback only, an embedded SQLite file, no API key, small limits)."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from planner.limits import DEFAULT_MAX_LAYERS

DAY_S = 86_400.0


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PIPEPLAN_", extra="ignore")

    host: str = "127.0.0.1"  # loopback only unless asked otherwise
    port: int = Field(default=8000, ge=0, le=65535)
    db: str = "pipeplan.db"  # SQLite file (":memory:" is not shared across threads; use a file)
    # set => `Authorization: Bearer <key>` on every /v1 route. `api_key` is one shared key (its
    # client name is "default"); `api_keys` gives each client its own: "alice:KEY1,bob:KEY2" or
    # JSON {"alice": "KEY1"}. Quotas are counted per client name.
    api_key: SecretStr | None = None
    api_keys: Annotated[dict[str, SecretStr], NoDecode] = Field(default_factory=dict)

    workers: int = Field(default=2, ge=1, le=64)  # solver processes running at once
    render_workers: int = Field(default=1, ge=1, le=16)  # processes drawing timelines
    queue_size: int = Field(default=32, ge=0, le=10_000)  # solves waiting for a worker
    render_queue_size: int = Field(default=256, ge=0, le=10_000)  # renders waiting
    sync_wait_s: float = Field(default=2.0, ge=0)  # POST /v1/plans waits this long before 202
    retry_after_s: int = Field(default=5, ge=1)  # Retry-After on 503 (queue full)
    poll_after_s: int = Field(default=1, ge=1)  # Retry-After on 202 (poll the job then)
    max_time_limit_s: float = Field(default=60.0, gt=0)  # solver time limits are clamped to this
    # a solve still running at its deadline + grace is stopped (its process killed) and its job
    # fails with error_kind "timeout": the heuristics' deadline is time_limit_s, the search's its
    # own wall-clock net (`planner.solve.solve_deadline_s`: its budget is work, the CLI's plan)
    solve_grace_s: float = Field(default=1.0, ge=0)
    render_timeout_s: float = Field(default=60.0, gt=0)
    # memory a solver or render process may take beyond what it starts with (0: no limit); past
    # it the job fails with an error that says so, and the process is replaced
    worker_memory_mb: int = Field(default=4096, ge=0)

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)  # larger bodies get 413
    body_timeout_s: float = Field(default=30.0, gt=0)  # a body not arrived by then gets 408
    header_timeout_s: float = Field(default=30.0, gt=0)  # and headers (api.protocol)
    write_timeout_s: float = Field(default=30.0, gt=0)  # a response the client does not read (api.protocol)
    max_layers: int = Field(default=DEFAULT_MAX_LAYERS, ge=1)
    max_edges: int = Field(default=100_000, ge=1)
    max_extra_bytes: int = Field(default=64 * 1024, ge=0)  # fields the format does not define, per profile
    max_devices: int = Field(default=4_096, ge=1)
    max_microbatches: int = Field(default=4_096, ge=1)
    max_compare_methods: int = Field(default=8, ge=1)
    timeline_max_events: int = Field(default=200_000, ge=1)  # larger schedules: 422 for the pictures
    trace_max_events: int = Field(default=200_000, ge=1)  # and for trace.json

    # retention: finished jobs and rendered timelines beyond these counts or ages are deleted
    # (0 = keep forever); swept at start and every retention_interval_s
    keep_jobs: int = Field(default=10_000, ge=0)
    keep_jobs_s: float = Field(default=30 * DAY_S, ge=0)
    keep_renders: int = Field(default=2_000, ge=0)
    keep_renders_s: float = Field(default=30 * DAY_S, ge=0)
    retention_interval_s: float = Field(default=300.0, gt=0)

    # per-client quotas (0 = none): requests per minute, and bytes of profiles and plans stored
    quota_requests_per_minute: int = Field(default=0, ge=0)
    quota_stored_bytes: int = Field(default=0, ge=0)

    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)  # e.g. "https://a,https://b"
    gzip_min_bytes: int = Field(default=1024, ge=0)
    log_json: bool = True  # access and error logs as JSON lines with the request id

    @field_validator("api_keys", mode="before")
    @classmethod
    def _keys(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("{"):
                return json.loads(text)
            pairs = [p.strip() for p in text.split(",") if p.strip()]
            out = {}
            for p in pairs:
                name, sep, key = p.partition(":")
                if not sep or not name or not key:
                    raise ValueError("api_keys: write name:key pairs separated by commas")
                out[name.strip()] = key.strip()
            return out
        return value

    @field_validator("cors_origins", mode="before")
    @classmethod
    def _origins(cls, value: object) -> object:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                return json.loads(text)
            return [o.strip() for o in text.split(",") if o.strip()]
        return value

    def api_key_value(self) -> str | None:
        return self.api_key.get_secret_value() if self.api_key else None

    def clients(self) -> dict[str, str]:
        """Client name -> key, for every key this server accepts (empty: no key needed)."""
        out = {name: key.get_secret_value() for name, key in self.api_keys.items()}
        if self.api_key is not None:
            out.setdefault("default", self.api_key.get_secret_value())
        return out

    @property
    def keyed(self) -> bool:
        return self.api_key is not None or bool(self.api_keys)
