"""Dependencies, declared once: settings, storage, the job queue and the API-key check. The
app keeps the objects on `app.state`; tests build an app with their own Settings, or swap any
of these with `app.dependency_overrides`."""

from __future__ import annotations

import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from api.jobs import JobManager
from api.settings import Settings
from api.storage import Storage


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_storage(request: Request) -> Storage:
    return request.app.state.storage


def get_jobs(request: Request) -> JobManager:
    return request.app.state.jobs


SettingsDep = Annotated[Settings, Depends(get_settings)]
StorageDep = Annotated[Storage, Depends(get_storage)]
JobsDep = Annotated[JobManager, Depends(get_jobs)]

bearer = HTTPBearer(auto_error=False, description="needed when the server sets PIPEPLAN_API_KEY")


def require_api_key(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    key = settings.api_key_value()
    if key is None:
        return
    if credentials is None or not secrets.compare_digest(credentials.credentials.encode(), key.encode()):
        raise HTTPException(401, detail="missing or wrong API key: send 'Authorization: Bearer <key>'",
                            headers={"WWW-Authenticate": "Bearer"})
