"""/v1/profiles: store a profile.json (validated), read it back, list them, delete one."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, Response

from api import service
from api.body import StrictJSONRoute
from api.deps import ClientDep, SettingsDep, StorageDep
from api.routers.common import Limit, Offset, errors
from api.schemas import ProfileCreated, ProfileOut, ProfilePage, ProfileSummary
from api.wording import shown_id
from planner.formats import Profile

router = APIRouter(prefix="/v1/profiles", tags=["profiles"], route_class=StrictJSONRoute)


@router.post("", status_code=201, response_model=ProfileCreated,
             responses={200: {"model": ProfileCreated, "description": "already stored"},
                        **errors(413, 422)})
def create_profile(profile: Profile, storage: StorageDep, settings: SettingsDep, client: ClientDep,
                   response: Response) -> ProfileCreated:
    """Store a profile; the same profile twice returns the first (200)."""
    row, created = service.store_profile(storage, settings, profile, ["body"], client)
    response.status_code = 201 if created else 200
    response.headers["Location"] = f"/v1/profiles/{row.id}"
    return ProfileCreated(id=row.id, sha256=row.sha256, model_path=row.model_path,
                          num_layers=row.num_layers, created_at=row.created_at, created=created)


@router.get("", response_model=ProfilePage, responses=errors(422))
def list_profiles(storage: StorageDep, limit: Limit = 20, offset: Offset = 0) -> ProfilePage:
    """Stored profiles, oldest first."""
    rows, total = storage.list_profiles(limit, offset)
    items = [ProfileSummary(id=r.id, sha256=r.sha256, model_path=r.model_path,
                            num_layers=r.num_layers, created_at=r.created_at) for r in rows]
    return ProfilePage(items=items, total=total, limit=limit, offset=offset)


@router.get("/{profile_id}", response_model=ProfileOut, responses=errors(404))
def get_profile(profile_id: str, storage: StorageDep) -> ProfileOut:
    row = storage.get_profile(profile_id)
    if row is None:
        raise HTTPException(404, detail=f"no profile with id {shown_id(profile_id)}")
    return ProfileOut(id=row.id, sha256=row.sha256, model_path=row.model_path,
                      num_layers=row.num_layers, created_at=row.created_at,
                      profile=Profile.model_validate(row.body))


@router.delete("/{profile_id}", status_code=204, response_class=Response, responses=errors(404, 409))
def delete_profile(profile_id: str, storage: StorageDep) -> Response:
    """Delete a profile with every plan made from it (and their timelines); 409 while a job
    that uses it is queued or running."""
    deleted = storage.delete_profile(profile_id)
    if deleted is None:
        raise HTTPException(409, detail=f"profile {profile_id} is used by a job still queued or "
                            "running; cancel it (DELETE /v1/jobs/{id}) or wait for it")
    if not deleted:
        raise HTTPException(404, detail=f"no profile with id {shown_id(profile_id)}")
    return Response(status_code=204)
