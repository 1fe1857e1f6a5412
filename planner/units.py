"""Units for people: byte counts in decimal units (1 GB = 1e9 bytes, as in cluster.json)."""

from planner.formats import GB


def format_bytes(nbytes: float) -> str:
    """`format_bytes(5.85e6) == "5.85 MB"`: the largest unit that keeps the number >= 1."""
    for unit, size in (("GB", GB), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"
