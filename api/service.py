"""Planning requests between the routes and the job queue: resolve the profile, apply the
server's limits (clamping the time limit and saying so), compute the cache key, and turn what a
solver process returns into stored plans or a comparison table.

Cache key = sha256 of {planner version, profile sha256, canonical cluster JSON, canonical
options JSON after clamping}: the same request twice finds the stored plan instead of solving
again, and a server with another planner (an upgrade) solves it afresh. The planner version is
the package version plus a digest of the planner's source files, so any change of the planner
counts.

Limits are checked cheapest first: on the raw JSON document (`precheck_*`: how many layers, how
many devices a cluster declares) before pydantic builds anything proportional to the input.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request
from pydantic import BaseModel

from api.jobs import Outcome, ResultHandler
from api.schemas import CompareOut, CompareRow, JobOut, PlanOut, PlanRequest
from api.settings import Settings
from api.storage import JobRow, PlanRow, ProfileRow, Storage
from api.wording import shown_id
from planner.build import largest_divisor_size
from planner.errors import PipeplanError
from planner.formats import MAX_MICROBATCHES, Cluster, PlanOptions, Profile, digest_data
from planner.limits import MIN_POSITIVE, out_of_range, small_divisor


@dataclass(frozen=True)
class Prepared:
    profile_row: ProfileRow
    profile: Profile
    cluster: Cluster
    options: PlanOptions
    warnings: list[str]
    key: str


def limit_error(loc: list[str | int], msg: str) -> HTTPException:
    return HTTPException(422, detail=[{"loc": loc, "msg": msg, "type": "limit"}])


@cache
def planner_version() -> str:
    """`<package version>+<digest of planner/**/*.py>`: changes with any change of the planner."""
    import planner

    try:
        version = metadata.version("pipeplan")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    root = Path(planner.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return f"{version}+{h.hexdigest()[:12]}"


# ---------------------------------------------------------------- cheap checks on raw JSON


def declared_devices(cluster: Any) -> int | None:
    """Devices a raw cluster document declares, without expanding its nodes (None: not a
    well-formed count; validation will say why)."""
    if not isinstance(cluster, dict):
        return None
    nodes = cluster.get("nodes")
    if isinstance(nodes, bool):
        return None
    if isinstance(nodes, int):
        per = cluster.get("devices_per_node")
        return nodes * per if isinstance(per, int) and not isinstance(per, bool) and per > 0 else nodes
    if isinstance(nodes, list):
        total = 0
        for node in nodes:
            d = node.get("devices") if isinstance(node, dict) else None
            total += d if isinstance(d, int) and not isinstance(d, bool) and d > 0 else 1
        return total
    return None


def precheck_cluster(doc: Any, settings: Settings, loc: list[str | int]) -> None:
    n = declared_devices(doc)
    if n is not None and n > settings.max_devices:
        raise limit_error(loc, f"{n} devices; this server plans for at most {settings.max_devices} "
                          "(PIPEPLAN_MAX_DEVICES)")


def precheck_profile(doc: Any, settings: Settings, loc: list[str | int]) -> None:
    if not isinstance(doc, dict):
        return
    layers, edges = doc.get("layers"), doc.get("edges")
    if isinstance(layers, list) and len(layers) > settings.max_layers:
        raise limit_error([*loc, "layers"], f"{len(layers)} layers; this server accepts at most "
                          f"{settings.max_layers} (PIPEPLAN_MAX_LAYERS)")
    if isinstance(edges, list) and len(edges) > settings.max_edges:
        raise limit_error([*loc, "edges"], f"{len(edges)} edges; this server accepts at most "
                          f"{settings.max_edges} (PIPEPLAN_MAX_EDGES)")


def precheck_profile_body(request: Request, doc: Any) -> None:
    precheck_profile(doc, request.app.state.settings, ["body"])


def precheck_plan_body(request: Request, doc: Any) -> None:
    if isinstance(doc, dict):
        settings = request.app.state.settings
        precheck_cluster(doc.get("cluster"), settings, ["body", "cluster"])
        precheck_profile(doc.get("profile"), settings, ["body", "profile"])


def extra_bytes(obj: Any) -> int:
    """Bytes (as JSON) of every field `obj` holds beyond its format, nested models included."""
    total = 0
    if isinstance(obj, BaseModel):
        extra = obj.__pydantic_extra__ or {}
        if extra:
            total += len(json.dumps(extra, default=str))
        for name in type(obj).model_fields:
            total += extra_bytes(getattr(obj, name))
    elif isinstance(obj, list):
        for item in obj:
            total += extra_bytes(item)
    return total


MAX_MICROBATCH_SIZES = 64  # candidate microbatch sizes a request may list


def check_range(doc: Any, loc: list[str | int], min_positive: float = 0.0) -> None:
    """Every number of `doc` in range; with `min_positive`, the divisors among them (bandwidths,
    memory, speeds, efficiencies: fields named `*gb_per_s`, `*memory_gb`, `*efficiency`, `speed`) no smaller where positive.
    (Applied to every number, it refused a latency of 1e-7 us or a calibration's residual of
    1e-9 that the command line reads.)"""
    bad = out_of_range(doc)
    if bad is None and min_positive > 0:
        bad = small_divisor(doc, (), min_positive)
    if bad is not None:
        raise limit_error([*loc, *bad[0]], bad[1])


# ---------------------------------------------------------------- profiles


def check_quota(storage: Storage, settings: Settings, owner: str, adding: int,
                what: str | None = None) -> None:
    """413 if storing `adding` more bytes (`what`, when their number is not known yet: a plan
    to be made) would take `owner` over its stored-bytes quota."""
    quota = settings.quota_stored_bytes
    if not quota:
        return
    used = storage.stored_bytes(owner)
    if used + adding > quota:
        raise HTTPException(413, detail=f"client {owner!r} stores {used} of its {quota} bytes "
                            "(PIPEPLAN_QUOTA_STORED_BYTES); storing "
                            f"{what or f'this ({adding} bytes)'} would take it over; delete "
                            "profiles or plans first")


def store_profile(storage: Storage, settings: Settings, profile: Profile,
                  loc: list[str | int], owner: str = "") -> tuple[ProfileRow, bool]:
    if len(profile.layers) > settings.max_layers:
        raise limit_error([*loc, "layers"], f"{len(profile.layers)} layers; this server accepts "
                          f"at most {settings.max_layers} (PIPEPLAN_MAX_LAYERS)")
    extra = extra_bytes(profile)
    if extra > settings.max_extra_bytes:
        raise limit_error(loc, f"{extra} bytes of fields the profile format does not define; this "
                          f"server keeps at most {settings.max_extra_bytes} per profile "
                          "(PIPEPLAN_MAX_EXTRA_BYTES)")
    body = profile.model_dump(mode="json", exclude_none=True)  # the canonical form (digest)
    check_range(body, loc)
    sha = digest_data(body)  # == digest(profile), without dumping the profile a second time
    row = storage.get_profile_by_sha(sha)
    if row is not None:
        return row, False
    # the check and the write as one: uploads in parallel each passed the check
    with QUOTA_LOCK if settings.quota_stored_bytes else contextlib.nullcontext():
        check_quota(storage, settings, owner, len(json.dumps(body)))
        return storage.put_profile(sha, profile.model.path, len(profile.layers), body, owner)


# one server per database (api.storage.lock_database), so a lock of this process orders every
# check of a quota before the write it allows
QUOTA_LOCK = threading.Lock()


def resolve_profile(storage: Storage, settings: Settings, req: PlanRequest,
                    owner: str = "") -> tuple[ProfileRow, Profile]:
    if req.profile is not None:
        row, _ = store_profile(storage, settings, req.profile, ["body", "profile"], owner)
        return row, req.profile
    assert req.profile_id is not None
    row = storage.get_profile(req.profile_id)
    if row is None:
        raise HTTPException(404, detail=f"no profile with id {shown_id(req.profile_id)}; "
                            "POST it to /v1/profiles or send it inline as 'profile'")
    assert row.body is not None
    return row, Profile.model_validate(row.body)


# ---------------------------------------------------------------- plan requests


def clamp_options(options: PlanOptions, settings: Settings) -> tuple[PlanOptions, list[str]]:
    warnings = []
    cap = settings.max_time_limit_s
    if options.time_limit_s > cap:
        warnings.append(f"options.time_limit_s {options.time_limit_s:g} s is above this server's "
                        f"cap; clamped to {cap:g} s")
        options = options.model_copy(update={"time_limit_s": cap})
    return options, warnings


def check_limits(profile: Profile, cluster: Cluster, options: PlanOptions, settings: Settings) -> None:
    precheck_cluster(cluster.model_dump(mode="json"), settings, ["body", "cluster"])
    check_range(cluster.model_dump(mode="json"), ["body", "cluster"], MIN_POSITIVE)
    check_range(options.model_dump(mode="json"), ["body", "options"])
    if len(options.microbatch_sizes or []) > MAX_MICROBATCH_SIZES:
        raise limit_error(["body", "options", "microbatch_sizes"],
                          f"{len(options.microbatch_sizes or [])} microbatch sizes; give at most "
                          f"{MAX_MICROBATCH_SIZES}")
    # the sizes the planner plans: microbatch_size, else microbatch_sizes, else the largest
    # divisor of global_batch up to the profile's batch size (`resolve_microbatch`: a prime
    # global batch makes microbatches of 1)
    microbatches: int | str  # (a count, or what is known of it)
    if options.microbatch_size or options.microbatch_sizes:
        sizes = [options.microbatch_size] if options.microbatch_size else options.microbatch_sizes or []
        microbatches = -(-options.global_batch // min(sizes))
        which = "microbatch_size" if options.microbatch_size else "the smallest of microbatch_sizes"
    else:
        most = max(settings.max_microbatches, MAX_MICROBATCHES)
        try:
            b = largest_divisor_size(profile.batch_size, options.global_batch, most)
            microbatches = options.global_batch // b
        except PipeplanError:  # its largest divisor up to the batch size makes more than that
            b, microbatches = 0, f"more than {most}"
        which = (f"microbatch_size (unset: the largest divisor of global_batch up to the profile's "
                 f"batch size {profile.batch_size}{f', {b}' if b else ''})")
    if isinstance(microbatches, str) or microbatches > settings.max_microbatches:
        raise limit_error(["body", "options", "global_batch"],
                          f"{microbatches} microbatches; this server simulates at most "
                          f"{settings.max_microbatches} (PIPEPLAN_MAX_MICROBATCHES): raise {which} "
                          "or lower global_batch")


def cache_key(profile_sha256: str, cluster: Cluster, options: PlanOptions) -> str:
    return digest_data({"planner": planner_version(), "profile_sha256": profile_sha256,
                        "cluster": cluster.model_dump(mode="json"),
                        "options": options.model_dump(mode="json")})


def prepare(storage: Storage, settings: Settings, req: PlanRequest, owner: str = "") -> Prepared:
    options, warnings = clamp_options(req.options, settings)
    precheck_cluster(req.cluster.model_dump(mode="json"), settings, ["body", "cluster"])
    row, profile = resolve_profile(storage, settings, req, owner)
    check_limits(profile, req.cluster, options, settings)
    return Prepared(row, profile, req.cluster, options, warnings, cache_key(row.sha256, req.cluster, options))


def task_payload(prep: Prepared, kind: str, methods: list[str] | None = None) -> dict[str, Any]:
    payload = {"kind": kind, "profile": prep.profile_row.body, "cluster": prep.cluster.model_dump(mode="json"),
               "options": prep.options.model_dump(mode="json")}
    if methods is not None:
        payload["methods"] = methods
        # each method's own options (`method_prepared`: without those only "manual" reads)
        payload["method_options"] = {m: method_prepared(prep, m).options.model_dump(mode="json")
                                     for m in methods}
    return payload


def job_request(prep: Prepared, methods: list[str] | None = None) -> dict[str, Any]:
    """What a job row keeps of its request (not the profile: that is stored by id)."""
    return {"profile_id": prep.profile_row.id, "cluster": prep.cluster.model_dump(mode="json"),
            "options": prep.options.model_dump(mode="json"), "methods": methods,
            "warnings": prep.warnings}


def _solver_failure(status: str, value: Any) -> Outcome:
    kind = "user" if status == "user" else "internal"
    return Outcome("failed", error=str(value), error_kind=kind)


class NotStored(Exception):
    """A solved plan that is not kept: why, and the job's error_kind ("user" | "quota")."""

    def __init__(self, message: str, kind: str = "user") -> None:
        super().__init__(message)
        self.kind = kind


def _store_plan(storage: Storage, settings: Settings, key: str, profile_id: str, method: str,
                doc: dict[str, Any], owner: str = "") -> PlanRow:
    """Store a solved plan. NotStored where its numbers overflowed, its profile was deleted
    meanwhile, or its client is at its stored-bytes quota by now: the request's own check ran
    before the solve, so requests solving at once each passed it (six of 11 kB each were all
    stored against a quota of 20 kB); with this one, a client goes over by one plan at most."""
    bad = out_of_range(doc)
    if bad is not None:
        where = ".".join(str(p) for p in bad[0])
        raise NotStored(f"the plan's {where}: {bad[1]}; the profile's or cluster's numbers are out of range")
    with QUOTA_LOCK if settings.quota_stored_bytes else contextlib.nullcontext():
        try:
            check_quota(storage, settings, owner, 1, "this plan")
        except HTTPException as exc:
            raise NotStored(str(exc.detail), "quota") from None
        row = storage.put_plan(key, profile_id, method, doc, meta={}, owner=owner)
    if row is None:
        raise NotStored(f"the profile {shown_id(profile_id)} was deleted while this plan was being "
                        "made, so the plan was not kept; POST the profile again and send the request again")
    return row


def plan_handler(storage: Storage, settings: Settings, prep: Prepared, owner: str = "") -> ResultHandler:
    def handle(status: str, value: Any) -> Outcome:
        if status != "ok":
            return _solver_failure(status, value)
        try:
            row = _store_plan(storage, settings, prep.key, prep.profile_row.id, prep.options.method,
                              value["plan"], owner)
        except NotStored as exc:
            return Outcome("failed", error=str(exc), error_kind=exc.kind)
        return Outcome("succeeded", plan_id=row.id)

    return handle


# ---------------------------------------------------------------- compare


def compare_row(method: str, plan_id: str, doc: dict[str, Any]) -> CompareRow:
    predicted, solver, stages = doc["predicted"], doc.get("solver") or {}, doc["stages"]
    return CompareRow(
        method=method, status="ok", plan_id=plan_id,
        iteration_ms=predicted["iteration_ms"],
        throughput_samples_per_s=predicted["throughput_samples_per_s"],
        bubble_fraction=predicted["bubble_fraction"],
        ratio_to_lower_bound=predicted.get("ratio_to_lower_bound"),
        num_stages=len(stages), replicas=[s["replicas"] for s in stages],
        max_memory_bytes=max(s["predicted"]["memory_bytes"] for s in stages),
        solver_status=solver.get("status"), solver_wall_s=solver.get("wall_s"),
    )


def compare_table(profile_id: str, methods: list[str], rows: dict[str, CompareRow],
                  warnings: list[str]) -> CompareOut:
    ordered = [rows[m] for m in methods]
    ok = [r for r in ordered if r.status == "ok" and r.iteration_ms is not None]
    best = min(ok, key=lambda r: r.iteration_ms or 0.0).method if ok else None
    return CompareOut(profile_id=profile_id, best_method=best, warnings=warnings, rows=ordered)


# options only method "manual" reads: another method of a comparison plans without them
MANUAL_ONLY = ("split", "replicas", "recompute", "tp")


def method_prepared(prep: Prepared, method: str) -> Prepared:
    """The comparison's request as one method plans it: without the options only "manual"
    reads where it is another method (so its stored plan's options do not say it used them,
    and its cache key is that of the same single plan request)."""
    update: dict[str, Any] = {"method": method}
    if method != "manual":
        update.update({f: None for f in MANUAL_ONLY if getattr(prep.options, f) is not None})
    options = prep.options.model_copy(update=update)
    return Prepared(prep.profile_row, prep.profile, prep.cluster, options, prep.warnings,
                    cache_key(prep.profile_row.sha256, prep.cluster, options))


def compare_handler(storage: Storage, settings: Settings, prep: Prepared, methods: list[str],
                    done: dict[str, CompareRow], owner: str = "") -> ResultHandler:
    def handle(status: str, value: Any) -> Outcome:
        if status != "ok":
            return _solver_failure(status, value)
        rows = dict(done)
        for item in value["rows"]:
            method = item["method"]
            if "plan" not in item:
                rows[method] = CompareRow(method=method, status="error", error=item["error"])
                continue
            mprep = method_prepared(prep, method)
            try:
                row = _store_plan(storage, settings, mprep.key, prep.profile_row.id, method,
                                  item["plan"], owner)
            except NotStored as exc:
                rows[method] = CompareRow(method=method, status="error", error=str(exc))
                continue
            assert row.body is not None
            rows[method] = compare_row(method, row.id, row.body)
        table = compare_table(prep.profile_row.id, methods, rows, prep.warnings)
        return Outcome("succeeded", result=table.model_dump(mode="json"))

    return handle


# ---------------------------------------------------------------- responses


def plan_links(plan_id: str) -> dict[str, str]:
    base = f"/v1/plans/{plan_id}"
    return {"self": base, "timeline_svg": f"{base}/timeline.svg", "timeline_png": f"{base}/timeline.png",
            "trace": f"{base}/trace.json"}


def plan_out(row: PlanRow, cached: bool, warnings: list[str]) -> PlanOut:
    return PlanOut(id=row.id, profile_id=row.profile_id, method=row.method, iteration_ms=row.iteration_ms,
                   created_at=row.created_at, cached=cached, warnings=warnings,
                   links=plan_links(row.id), plan=row.body)


def job_out(job: JobRow) -> JobOut:
    """The job as the API shows it."""
    links = {"self": f"/v1/jobs/{job.id}"}
    if job.plan_id:
        links["plan"] = f"/v1/plans/{job.plan_id}"
    return JobOut(id=job.id, kind=job.kind, status=job.status, created_at=job.created_at,
                  started_at=job.started_at, finished_at=job.finished_at, plan_id=job.plan_id,
                  result=job.result, error=job.error, error_kind=job.error_kind,
                  warnings=job.request.get("warnings") or [], links=links)
