"""pipeplan's planning service: a FastAPI app over the planner, persisted in SQLite.

Serve it with `python -m planner serve [--host 127.0.0.1] [--port 8000] [--db pipeplan.db]
[--workers N]` (settings also from `PIPEPLAN_*` environment variables, see `api.settings`).
OpenAPI at `/docs`. Layout: `settings` (environment), `storage` (SQL), `jobs` (solver
processes), `worker` (what runs in them), `service` (cache keys, limits, results), `schemas`
(request/response bodies), `deps` (dependencies), `limits` (body size), `timeline` (Gantt
charts), `routers/` (one per resource), `app.create_app(settings)`.
"""
