"""What an operator sees: request ids, Prometheus metrics, JSON logs.

`RequestContext` (plain ASGI middleware) takes the client's `X-Request-ID` (1-128 characters of
`[A-Za-z0-9._:-]`) or makes one, keeps it in `scope["state"]["request_id"]` (handlers and the
error responses read it there), echoes it on the response, counts the request in `Metrics` by
route template and status, and logs one access line. `Metrics.render()` is the Prometheus text
exposition format (no client library needed). `JsonFormatter` writes one JSON object per log
record, with the request id when the record has one.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("api.access")

REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
SOLVE_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)


def request_id(scope: dict[str, Any]) -> str:
    return scope.get("state", {}).get("request_id", "")


def _labels(names: tuple[str, ...], values: tuple[str, ...]) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return ",".join(f'{n}="{esc(v)}"' for n, v in zip(names, values, strict=True))


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.total += 1
        self.sum += value


class Metrics:
    """Counters and histograms of the service; gauges are read when rendered."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], int] = {}  # (route, method, status)
        self.latency: dict[tuple[str, str], Histogram] = {}  # (route, method)
        self.solves: dict[tuple[str, str, str], Histogram] = {}  # (kind, method, outcome)
        self.gauges: dict[str, Callable[[], float]] = {}

    def request(self, route: str, method: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (route, method, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1
            self.latency.setdefault((route, method), Histogram(LATENCY_BUCKETS)).observe(seconds)

    def solve(self, kind: str, method: str, outcome: str, seconds: float) -> None:
        with self._lock:
            self.solves.setdefault((kind, method, outcome), Histogram(SOLVE_BUCKETS)).observe(seconds)

    def render(self) -> str:
        out: list[str] = []
        with self._lock:
            out += ["# HELP pipeplan_http_requests_total HTTP requests by route template, method and status.",
                    "# TYPE pipeplan_http_requests_total counter"]
            for (route, method, status), n in sorted(self.requests.items()):
                out.append(f"pipeplan_http_requests_total{{{_labels(('route', 'method', 'status'), (route, method, status))}}} {n}")
            out += self._histograms("pipeplan_http_request_duration_seconds",
                                    "HTTP request latency by route template and method.",
                                    ("route", "method"), self.latency)
            out += self._histograms("pipeplan_solve_duration_seconds",
                                    "Time a worker process spent on one solve, by kind, method and outcome.",
                                    ("kind", "method", "outcome"), self.solves)
            gauges = dict(self.gauges)
        for name, read in sorted(gauges.items()):
            out += [f"# TYPE {name} gauge", f"{name} {float(read()):g}"]
        return "\n".join(out) + "\n"

    @staticmethod
    def _histograms(name: str, help_text: str, label_names: tuple[str, ...],
                    series: dict[Any, Histogram]) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for key, h in sorted(series.items()):
            base = _labels(label_names, key)
            for b, c in zip(h.buckets, h.counts, strict=True):
                out.append(f'{name}_bucket{{{base},le="{b:g}"}} {c}')
            out.append(f'{name}_bucket{{{base},le="+Inf"}} {h.total}')
            out.append(f"{name}_sum{{{base}}} {h.sum:.6f}")
            out.append(f"{name}_count{{{base}}} {h.total}")
        return out


class RequestContext:
    """Request id, metrics and the access log, around everything else."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = ""
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                given = value.decode("latin-1")
                break
        rid = given if REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        t0 = time.perf_counter()

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [_relative(h) if status in (307, 308) else h
                           for h in message.get("headers", []) if h[0].lower() != b"x-request-id"]
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            seconds = time.perf_counter() - t0
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            # a method a client invents is counted as "other": one series each would let any
            # client grow /metrics (and this process's memory) without bound
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.request(template, method, status, seconds)
            log.info("%s %s %d", scope["method"], scope["path"], status,
                     extra={"request_id": rid, "method": scope["method"], "path": scope["path"],
                            "route": template, "status": status, "duration_ms": round(seconds * 1e3, 2)})


def _relative(header: tuple[bytes, bytes]) -> tuple[bytes, bytes]:
    """A redirect's Location as a path: Starlette's trailing-slash redirect names the host the
    client's Host header gave (`Host: evil.example` got `Location: http://evil.example/...`, which
    a cache in front could serve to others; an outside review)."""
    name, value = header
    if name.lower() != b"location":
        return header
    url = urlsplit(value.decode("latin-1"))
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return name, path.encode("latin-1")


HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and the request's fields."""

    FIELDS = ("request_id", "method", "path", "route", "status", "duration_ms", "job_id")

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for name in self.FIELDS:
            if hasattr(record, name):
                doc[name] = getattr(record, name)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


class TextFormatter(logging.Formatter):
    """Plain text, one line per message: control characters in a message (a request path is the
    client's, percent-decoded: `%0a` is a line break) are written escaped, so a client cannot
    add lines that read as the server's own (an outside review forged an access-log line)."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"),
                                      record.message)
        return super().formatMessage(record)


def log_config(level: str, json_lines: bool) -> dict[str, Any]:
    """A logging dictConfig for uvicorn and the service: JSON lines, or plain text (escaped)."""
    fmt = ({"()": JsonFormatter} if json_lines
           else {"()": TextFormatter, "fmt": "%(asctime)s %(levelname)s %(name)s %(message)s"})
    handler = {"class": "logging.StreamHandler", "formatter": "main", "stream": "ext://sys.stderr"}
    lvl = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"main": fmt},
        "handlers": {"main": handler},
        "loggers": {
            "uvicorn": {"handlers": ["main"], "level": lvl, "propagate": False},
            "uvicorn.error": {"handlers": ["main"], "level": lvl, "propagate": False},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},  # ours instead
            "api": {"handlers": ["main"], "level": lvl, "propagate": False},
        },
    }
