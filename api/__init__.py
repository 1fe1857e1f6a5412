"""pipeplan's planning service: a FastAPI app over the planner, persisted in SQLite.

Serve it with `python -m planner serve [--host 127.0.0.1] [--port 8000] [--db pipeplan.db]
[--workers N]` (settings also from `PIPEPLAN_*` environment variables, see `api.settings`).
OpenAPI at `/docs`. Layout: `settings` (environment), `storage` (SQL), `pool` (worker
processes, the render pool), `jobs` (the solve queue), `worker` (what runs in the processes),
`service` (cache keys, limits, results), `body` (strict JSON bodies), `schemas`
(request/response bodies), `openapi` (the completed schema), `docs` (local Swagger UI),
`observe` (request ids, metrics, JSON logs), `deps` (dependencies, API keys, quotas), `limits`
(body size), `timeline` (Gantt charts), `routers/` (one per resource), `app.create_app(settings)`.
"""
