"""pipeplan's planning service: a FastAPI app over the planner, persisted in SQLite."""
