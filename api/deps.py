"""Dependencies, declared once: settings, storage, the job queue, the render pool, and the
client check (API key -> client name, per-client request quota). The app keeps the objects on
`app.state`; tests build an app with their own Settings, or swap any of these with
`app.dependency_overrides`."""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.jobs import JobManager
from api.limits import Unauthorized
from api.pool import RenderPool
from api.settings import Settings
from api.storage import Storage


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_storage(request: Request) -> Storage:
    return request.app.state.storage


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


def get_renders(request: Request) -> RenderPool:
    return request.app.state.renders


SettingsDep = Annotated[Settings, Depends(get_settings)]
StorageDep = Annotated[Storage, Depends(get_storage)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]
RendersDep = Annotated[RenderPool, Depends(get_renders)]

bearer = HTTPBearer(auto_error=False, description="one of the server's API keys (PIPEPLAN_API_KEY(S))")


class RateLimiter:
    """Per-client token buckets: `per_minute` requests a minute, bursts up to that many."""

    def __init__(self, per_minute: int) -> None:
        self.per_minute = per_minute
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, last time)

    def take(self, client: str) -> float:
        """0 if the request may go ahead, else the seconds until it may."""
        if self.per_minute <= 0:
            return 0.0
        rate = self.per_minute / 60.0
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(client, (float(self.per_minute), now))
            tokens = min(float(self.per_minute), tokens + (now - last) * rate)
            if tokens >= 1.0:
                self._buckets[client] = (tokens - 1.0, now)
                return 0.0
            self._buckets[client] = (tokens, now)
            return (1.0 - tokens) / rate


def client_name(request: Request, settings: Settings,
                credentials: HTTPAuthorizationCredentials | None) -> str:
    """The client a request comes from: its key's name (401 without a valid key when the server
    has keys), else "anonymous"."""
    clients = settings.clients()
    if not clients:
        return "anonymous"
    if credentials is not None and (name := _key_owner(credentials.credentials.encode(), clients)):
        return name
    raise Unauthorized()


def _key_owner(token: bytes, clients: dict[str, str]) -> str | None:
    """The client whose key `token` is, compared with every key (no timing hint which matched)."""
    owners = [name for name, key in clients.items() if secrets.compare_digest(token, key.encode())]
    return owners[0] if owners else None


def key_is_valid(headers: list[tuple[bytes, bytes]], settings: Settings) -> bool:
    """An ASGI request's headers carry one of the server's API keys (or it has none): what
    the body-size middleware asks before it answers about a body (`api.limits`)."""
    clients = settings.clients()
    if not clients:
        return True
    for name, value in headers:
        if name.lower() == b"authorization":  # the first one, as the route's check reads it
            scheme, _, given = value.decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":
                return False
            return _key_owner(given.strip().encode(), clients) is not None
    return False


def _check_client(request: Request, settings: Settings,
                  credentials: HTTPAuthorizationCredentials | None) -> str:
    if getattr(request.state, "client_checked", False):  # before the body (before_body)
        return request.state.client
    name = client_name(request, settings, credentials)
    wait = request.app.state.rate.take(name if settings.keyed else f"ip:{_host(request)}")
    if wait > 0:
        raise HTTPException(429, detail=f"client {name!r} is over its quota of "
                            f"{settings.quota_requests_per_minute} requests a minute "
                            "(PIPEPLAN_QUOTA_REQUESTS_PER_MINUTE); retry after Retry-After seconds",
                            headers={"Retry-After": str(max(1, math.ceil(wait)))})
    request.state.client = name
    request.state.client_checked = True
    return name


def _host(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def require_client(
    request: Request,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> str:
    """With API keys: the key's client name (401 otherwise). Counts the request quota."""
    return _check_client(request, settings, credentials)


def open_client(request: Request, settings: SettingsDep) -> str:
    """Without API keys: no security in the schema; counts the request quota per address."""
    return _check_client(request, settings, None)


async def before_body(request: Request) -> None:
    """The client check of `require_client` / `open_client`, run by api.body before a body is
    read (`app.state.before_body`); the dependency then finds it done."""
    settings: Settings = request.app.state.settings
    _check_client(request, settings, await bearer(request) if settings.keyed else None)


def client(request: Request) -> str:
    """The name the client check stored for this request."""
    return getattr(request.state, "client", "anonymous")


ClientDep = Annotated[str, Depends(client)]
