"""pipeplan's planner: file formats, cluster and cost model, solvers, schedules, simulator, CLI.

This package never imports torch (a test enforces it), so the planning service and the solver
install and run without it.
"""

from planner.errors import PipeplanError

__all__ = ["PipeplanError"]
