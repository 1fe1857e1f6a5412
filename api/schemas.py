"""Request and response bodies of the HTTP API (separate models; the file formats themselves —
Profile, Cluster, PlanOptions, Plan — come from `planner.formats`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from planner.formats import Cluster, Plan, PlanOptions, Profile, option_conflicts
from planner.solve import METHODS

MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type]

EXAMPLE_PROFILE = {
    "model": {"path": "model.py", "sha256": "0" * 64},
    "device": {"type": "cpu", "name": "example"},
    "batch_size": 8,
    "layers": [{"name": f"l{i}", "fwd_ms": 1.0 + i % 3, "bwd_ms": 2.0 + 2 * (i % 3),
                "param_bytes": 400_000_000, "activation_bytes": 200_000, "output_bytes": 50_000}
               for i in range(6)],
    "edges": [{"src": "<input>", "dst": "l0", "bytes": 10_000}]
    + [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 50_000} for i in range(5)],
}
EXAMPLE_CLUSTER = {"nodes": 1, "devices_per_node": 4, "device_memory_gb": 16,
                   "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10}
EXAMPLE_OPTIONS = {"global_batch": 32, "microbatch_size": 8, "method": "blocks", "time_limit_s": 2}


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- requests


class PlanOptionsIn(PlanOptions):
    """PlanOptions whose method must be one the planner knows (listed in the schema)."""

    method: MethodName = "cpsat"


class PlanRequest(_Request):
    """A profile (inline, or one stored earlier by id), a cluster, and the plan options."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["profile"]}, {"required": ["profile_id"]}],
        "examples": [{"profile": EXAMPLE_PROFILE, "cluster": EXAMPLE_CLUSTER, "options": EXAMPLE_OPTIONS}],
    })

    profile: Profile | None = Field(default=None, description="the profile.json itself")
    profile_id: str | None = Field(default=None, description="id of a profile stored with POST /v1/profiles")
    cluster: Cluster
    options: PlanOptionsIn = Field(default_factory=PlanOptionsIn)

    @model_validator(mode="after")
    def _one_profile(self) -> PlanRequest:
        if (self.profile is None) == (self.profile_id is None):
            raise ValueError("give exactly one of profile (inline) or profile_id (stored)")
        if self.options.split and "method" not in self.options.model_fields_set:
            # as on the command line: a split asks for the manual plan
            self.options = self.options.model_copy(update={"method": "manual"})
        # the command line's refusals (`planner plan`): an option the method would ignore
        conflict = option_conflicts(self.options, lambda f: f"options.{f}",
                                    method_matters=not isinstance(self, CompareRequest))
        if conflict:
            raise ValueError(conflict)
        return self


class CompareRequest(PlanRequest):
    """Like PlanRequest, solved once per method (options.method is ignored)."""

    model_config = ConfigDict(json_schema_extra={
        "oneOf": [{"required": ["profile"]}, {"required": ["profile_id"]}],
        "examples": [{"profile": EXAMPLE_PROFILE, "cluster": EXAMPLE_CLUSTER, "options": EXAMPLE_OPTIONS,
                      "methods": ["pipedream", "blocks", "uniform"]}],
    })

    methods: list[MethodName] | None = Field(
        default=None, min_length=1, max_length=16,
        description="methods to compare; default: every method this server knows",
    )


# ---------------------------------------------------------------- responses


class ErrorOut(BaseModel):
    """The one shape of every 4xx and 5xx answer."""

    detail: str | list[dict[str, Any]] = Field(
        description="what is wrong: a sentence, or (422) one item per field with loc, msg, type")
    request_id: str = Field(description="the X-Request-ID of the request (also in the server's log)")


class Health(BaseModel):
    status: Literal["ok"]
    workers: int
    running: int
    queued: int
    capacity: int


class Ready(BaseModel):
    status: Literal["ready", "not ready"]
    database: bool = Field(description="a write transaction succeeded")
    workers: bool = Field(description="every solver and render dispatcher is alive")
    detail: str | None = None


class Version(BaseModel):
    pipeplan: str
    planner: str = Field(description="package version + digest of the planner's sources (in every cache key)")
    api: str
    python: str


class ProfileSummary(BaseModel):
    id: str
    sha256: str = Field(description="sha256 of the profile's canonical JSON (plan.profile_sha256)")
    model_path: str
    num_layers: int
    created_at: str


class ProfileCreated(ProfileSummary):
    created: bool = Field(description="false when the same profile was already stored")


class ProfileOut(ProfileSummary):
    profile: Profile


class ProfilePage(BaseModel):
    items: list[ProfileSummary]
    total: int
    limit: int
    offset: int


class PlanSummary(BaseModel):
    id: str
    profile_id: str
    method: str
    iteration_ms: float | None
    created_at: str


class PlanOut(PlanSummary):
    cached: bool = Field(description="false only in the response whose request solved this plan")
    warnings: list[str] = Field(default_factory=list, description="e.g. a time limit clamped to the cap")
    links: dict[str, str]
    plan: Plan


class PlanPage(BaseModel):
    items: list[PlanSummary]
    total: int
    limit: int
    offset: int


class CompareRow(BaseModel):
    method: str
    status: Literal["ok", "error"]
    plan_id: str | None = None
    iteration_ms: float | None = None
    throughput_samples_per_s: float | None = None
    bubble_fraction: float | None = None
    ratio_to_lower_bound: float | None = None
    num_stages: int | None = None
    replicas: list[int] | None = None
    max_memory_bytes: int | None = None
    solver_status: str | None = None
    solver_wall_s: float | None = None
    error: str | None = None


class CompareOut(BaseModel):
    profile_id: str
    best_method: str | None = Field(description="the method with the lowest iteration_ms")
    warnings: list[str] = Field(default_factory=list)
    rows: list[CompareRow]


class JobOut(BaseModel):
    id: str
    kind: Literal["plan", "compare"]
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    created_at: str
    started_at: str | None
    finished_at: str | None
    plan_id: str | None = Field(description="kind plan: the plan, once succeeded")
    result: CompareOut | None = Field(description="kind compare: the table, once succeeded")
    error: str | None
    error_kind: str | None = Field(description="user | quota | internal | timeout | cancelled | shutdown | lost")
    warnings: list[str] = Field(default_factory=list)
    links: dict[str, str]


class JobPage(BaseModel):
    items: list[JobOut]
    total: int
    limit: int
    offset: int
