"""A candidate plan as plain numbers: what every partitioner (baselines, PipeDream's DP, CP-SAT)
returns, before the cost model and the simulator turn it into a plan.json."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StageChoice:
    start: int  # first layer index (topological order)
    stop: int  # one past the last layer index
    devices: tuple[int, ...]  # global ranks, replicas x tp of them, replica-major
    recompute: bool = False  # keep only each block's inputs, recompute its forward in backward
    tp: int = 1  # tensor-parallel degree: replica k is devices[k*tp:(k+1)*tp]

    @property
    def replicas(self) -> int:
        return len(self.devices) // self.tp

    @property
    def replica_ranks(self) -> tuple[int, ...]:
        """The first rank of each replica (what the schedule and the simulator track)."""
        return self.devices[::self.tp]


@dataclass(frozen=True)
class Candidate:
    stages: tuple[StageChoice, ...]
    microbatch_size: int
    num_microbatches: int
    # what the method says about its own answer (solver name, status, objective, bound, gap, wall_s)
    solver: dict[str, object] = field(default_factory=dict)
    schedule: str | None = None  # the schedule the method chose (with --schedule auto)

    def check(self, num_layers: int, num_devices: int) -> None:
        """Parallel degrees are checked once, where the object is built (torchtitan's habit)."""
        if not self.stages:
            raise ValueError("a candidate needs at least one stage")
        if self.stages[0].start != 0 or self.stages[-1].stop != num_layers:
            raise ValueError(f"stages must cover layers 0..{num_layers - 1}")
        for a, b in zip(self.stages, self.stages[1:], strict=False):
            if a.stop != b.start:
                raise ValueError("stages must be contiguous and in order")
        for s in self.stages:
            if s.stop <= s.start or not s.devices:
                raise ValueError("every stage needs at least one layer and one device")
            if s.tp < 1 or len(s.devices) % s.tp:
                raise ValueError(f"a stage with tp {s.tp} needs a multiple of {s.tp} devices")
        used = [d for s in self.stages for d in s.devices]
        if len(set(used)) != len(used) or any(not 0 <= d < num_devices for d in used):
            raise ValueError("devices must be distinct ranks of the cluster")
