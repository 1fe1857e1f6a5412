"""The model's own value for a given candidate: the CP-SAT model with the candidate's structure
pinned (internal; used to report the model objective of a plan and to test that the model's
bound never exceeds the simulated time)."""

from __future__ import annotations

from ortools.sat.python import cp_model

from planner.cpsat.decode import structure_of
from planner.cpsat.instance import Instance
from planner.cpsat.model import build_model
from planner.cpsat.search import EXACT_SLOTS, _slot_literals
from planner.formats import Device
from planner.partition import Candidate


def model_value_ms(inst: Instance, candidate: Candidate, devices: list[Device],
                   max_stages: int | None = None, time_limit_s: float = 10.0) -> float | None:
    """The model's objective (ms) for `candidate`, or None if the model cannot represent it
    (a placement it does not offer) or finds it infeasible (memory)."""
    st = structure_of(inst, candidate, devices)
    if st is None:
        return None
    J = min(max_stages or inst.num_layers, inst.num_layers, inst.num_devices)
    h = build_model(inst, J, exact=J <= EXACT_SLOTS)
    for var, val in _slot_literals(h, st):
        h.model.Add(var == val)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.Solve(h.model)
    if status != cp_model.OPTIMAL:
        return None
    return solver.ObjectiveValue() / inst.unit_per_ms
