"""Sub-commands of `python -m planner`; each module has `register(subparsers)`."""
