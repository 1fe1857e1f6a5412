"""One router per resource: health, profiles, plans, jobs."""
