"""How fast does the planning service answer under load? A real server (`python -m planner
serve`) on 127.0.0.1, a bounded number of concurrent clients and a bounded number of requests:
p50/p99 latency of uncached plan requests (a solve each), cached ones (the same requests again),
and /healthz while every worker is busy; requests per second and errors. Then (issue 14):
`GET /v1/plans/{id}` while 48 first renders of 48 large timelines run (renders are drawn by the
render pool, not the HTTP process); a batch of hostile inputs (time to the 4xx, server RSS
growth); and each planning method on 5,000 layers x 4,096 devices with a time limit (time to
the answer: a plan, or the time-budget error).

    .venv/bin/python benchmarks/api_load.py [--clients 16] [--requests 200] [--workers 2]

Prints a table and writes benchmarks/results/api_load.json. Loopback only; the load generator
runs on the same machine as the server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
MAX_CLIENTS, MAX_REQUESTS = 64, 2000


def profile_doc(n_layers: int, param_bytes: int = 400_000_000) -> dict[str, Any]:
    layers = [{"name": f"l{i}", "fwd_ms": 1.0 + i % 3, "bwd_ms": 2.0 + 2 * (i % 3),
               "param_bytes": param_bytes, "activation_bytes": 200_000, "output_bytes": 50_000}
              for i in range(n_layers)]
    edges = [{"src": "<input>", "dst": "l0", "bytes": 10_000}]
    edges += [{"src": f"l{i}", "dst": f"l{i + 1}", "bytes": 50_000} for i in range(n_layers - 1)]
    return {"model": {"path": "bench.py", "sha256": "0" * 64}, "device": {"type": "cpu", "name": "bench"},
            "batch_size": 8, "layers": layers, "edges": edges}


def request_body(i: int, method: str) -> dict[str, Any]:
    """The i-th distinct request: 16 layers, 4-16 devices, global batch 32-512."""
    devices = (4, 8, 16)[i % 3]
    global_batch = 32 * (1 + (i // 3) % 16)
    return {"profile": profile_doc(16 + i // 48),
            "cluster": {"nodes": 1, "devices_per_node": devices, "device_memory_gb": 16,
                        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10},
            "options": {"method": method, "global_batch": global_batch, "microbatch_size": 8,
                        "time_limit_s": 5}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(db: Path, port: int, workers: int, queue_size: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PIPEPLAN_QUEUE_SIZE": str(queue_size), "PIPEPLAN_SYNC_WAIT_S": "60",
           "PIPEPLAN_RENDER_QUEUE_SIZE": "256", "PIPEPLAN_LOG_JSON": "false"}
    env.pop("PIPEPLAN_API_KEY", None)
    cmd = [sys.executable, "-m", "planner", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--db", str(db), "--workers", str(workers), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the server did not start within 60 s")


def summary(name: str, latencies_s: list[float], errors: int, wall_s: float, clients: int) -> dict[str, Any]:
    ms = sorted(x * 1e3 for x in latencies_s)

    def pct(p: float) -> float:
        return ms[min(len(ms) - 1, int(round(p / 100 * (len(ms) - 1))))] if ms else float("nan")

    return {"scenario": name, "requests": len(ms) + errors, "clients": clients, "errors": errors,
            "p50_ms": pct(50), "p99_ms": pct(99), "max_ms": ms[-1] if ms else float("nan"),
            "mean_ms": statistics.fmean(ms) if ms else float("nan"),
            "requests_per_s": (len(ms) + errors) / wall_s if wall_s > 0 else float("nan")}


async def run_requests(http: httpx.AsyncClient, bodies: list[dict[str, Any]], clients: int,
                       ok: tuple[int, ...]) -> tuple[list[float], int, float]:
    sem = asyncio.Semaphore(clients)
    latencies: list[float] = []
    errors = 0

    async def one(body: dict[str, Any]) -> None:
        nonlocal errors
        async with sem:
            t0 = time.perf_counter()
            try:
                r = await http.post("/v1/plans", json=body)
                good = r.status_code in ok
            except httpx.HTTPError:
                good = False
            if good:
                latencies.append(time.perf_counter() - t0)
            else:
                errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(b) for b in bodies))
    return latencies, errors, time.perf_counter() - t0


async def poll_health(http: httpx.AsyncClient, stop: asyncio.Event, period_s: float = 0.02
                      ) -> tuple[list[float], int, list[int]]:
    latencies, errors, running = [], 0, []
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            r = await http.get("/healthz")
            latencies.append(time.perf_counter() - t0)
            running.append(r.json()["running"])
        except httpx.HTTPError:
            errors += 1
        await asyncio.sleep(period_s)
    return latencies, errors, running


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def render_body(i: int) -> dict[str, Any]:
    """A plan of 16 stages x (128 + i) microbatches: 4k+ events to draw."""
    return {"profile": profile_doc(64, param_bytes=10_000_000),
            "cluster": {"nodes": 2, "devices_per_node": 8, "device_memory_gb": 16,
                        "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10},
            "options": {"method": "manual", "split": [4] * 16, "global_batch": 8 * (128 + i),
                        "microbatch_size": 8, "time_limit_s": 5}}


async def renders_vs_reads(http: httpx.AsyncClient, renders: int, pid: int) -> list[dict[str, Any]]:
    plans = []
    for i in range(renders):
        r = await http.post("/v1/plans", json=render_body(i))
        plans.append(r.json()["id"])
    probe = plans[0]
    await http.get(f"/v1/plans/{probe}")
    rss0 = rss_mb(pid)
    stop = asyncio.Event()
    reads: list[float] = []

    reader_http = httpx.AsyncClient(base_url=str(http.base_url), timeout=60)  # its own connection:
    # in the shared pool a read would wait for a connection the renders hold (client-side queueing)

    async def read_loop() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            r = await reader_http.get(f"/v1/plans/{probe}")
            if r.status_code == 200:
                reads.append(time.perf_counter() - t0)
            await asyncio.sleep(0.01)

    reader = asyncio.create_task(read_loop())
    done: list[float] = []
    errors = 0
    t0 = time.perf_counter()

    async def render(pid_: str) -> None:
        nonlocal errors
        r = await http.get(f"/v1/plans/{pid_}/timeline.png")
        if r.status_code == 200:
            done.append(time.perf_counter() - t0)
        else:
            errors += 1

    await asyncio.gather(*(render(p) for p in plans))
    wall = time.perf_counter() - t0
    stop.set()
    await reader
    await reader_http.aclose()
    return [summary(f"GET plan during {renders} first renders", reads, 0, wall, 1),
            summary(f"{renders} concurrent first renders (png)", done, errors, wall, renders)
            | {"server_rss_mb_before": rss0, "server_rss_mb_after": rss_mb(pid)}]


def hostile_bodies() -> list[tuple[str, str, bytes]]:
    plan = request_body(0, "blocks")
    text = json.dumps(plan)
    deep: Any = 1
    for _ in range(300):
        deep = {"x": deep}
    layer = '{"name":"l%d","fwd_ms":1,"bwd_ms":2,"param_bytes":1,"activation_bytes":1,"output_bytes":1}'
    big = ('{"model":{"path":"m.py","sha256":"0"},"device":{"type":"cpu","name":"x"},"batch_size":8,'
           f'"layers":[{",".join(layer % i for i in range(50_000))}]}}')
    return [
        ("nodes = 1e9", "/v1/plans", json.dumps({**plan, "cluster": {**plan["cluster"], "nodes": 10**9}}).encode()),
        ("NaN", "/v1/plans", text.replace('"time_limit_s": 5', '"time_limit_s": NaN').encode()),
        ("-Infinity", "/v1/plans", text.replace('"fwd_ms": 1.0', '"fwd_ms": -Infinity', 1).encode()),
        ("300-deep JSON", "/v1/profiles", json.dumps({**profile_doc(4), "extra": deep}).encode()),
        ("50k-layer profile", "/v1/profiles", big.encode()),
    ]


async def hostile(http: httpx.AsyncClient, pid: int, rounds: int = 5) -> list[dict[str, Any]]:
    rss0 = rss_mb(pid)
    rows = []
    bodies = hostile_bodies()
    for name, path, body in bodies:
        lat, statuses = [], set()
        for _ in range(rounds):
            t0 = time.perf_counter()
            r = await http.post(path, content=body, headers={"content-type": "application/json"})
            lat.append(time.perf_counter() - t0)
            statuses.add(r.status_code)
        rows.append(summary(f"hostile: {name}", lat, 0, sum(lat), 1) | {"statuses": sorted(statuses)})
    rows[-1]["server_rss_growth_mb"] = rss_mb(pid) - rss0
    return rows


def big_request(method: str, time_limit_s: float) -> dict[str, Any]:
    return {"profile": profile_doc(5_000, param_bytes=10_000_000),
            "cluster": {"nodes": 512, "devices_per_node": 8, "device_memory_gb": 80,
                        "intra_node_gb_per_s": 300, "inter_node_gb_per_s": 25},
            "options": {"method": method, "global_batch": 4096, "microbatch_size": 8,
                        "time_limit_s": time_limit_s}}


async def budgets(http: httpx.AsyncClient, time_limit_s: float) -> list[dict[str, Any]]:
    rows = []
    for method in ("uniform", "blocks", "params", "pipedream", "cpsat"):
        t0 = time.perf_counter()
        r = await http.post("/v1/plans", json=big_request(method, time_limit_s))
        elapsed = time.perf_counter() - t0
        rows.append(summary(f"5000 layers x 4096 dev: {method}", [elapsed], 0, elapsed, 1)
                    | {"status": r.status_code, "time_limit_s": time_limit_s,
                       "answer": (r.json().get("detail") if r.status_code >= 400 else "plan")})
    return rows


async def bench(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as http:
        # /healthz with nothing to do
        lat = []
        for _ in range(50):
            t0 = time.perf_counter()
            await http.get("/healthz")
            lat.append(time.perf_counter() - t0)
        rows.append(summary("healthz, idle", lat, 0, sum(lat), 1))

        # uncached: every request is a new solve (fast method); /healthz polled meanwhile
        bodies = [request_body(i, args.method) for i in range(args.requests)]
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(http, stop))
        lat, err, wall = await run_requests(http, bodies, args.clients, (201,))
        stop.set()
        h_lat, h_err, h_running = await poller
        rows.append(summary(f"plan, uncached ({args.method})", lat, err, wall, args.clients))
        rows.append(summary("healthz during uncached load", h_lat, h_err, wall, 1)
                    | {"max_running": max(h_running, default=0)})

        # cached: the same requests again
        lat, err, wall = await run_requests(http, bodies, args.clients, (200,))
        rows.append(summary("plan, cached", lat, err, wall, args.clients))

        # every worker busy with a long solve (cpsat, its time limit), /healthz meanwhile
        slow = [{"profile": profile_doc(120), "cluster": {
                    "nodes": 1, "devices_per_node": 16, "device_memory_gb": 16,
                    "intra_node_gb_per_s": 100, "inter_node_gb_per_s": 10},
                 "options": {"method": "cpsat", "global_batch": 64 * (i + 1), "microbatch_size": 8,
                             "time_limit_s": args.busy_s}} for i in range(args.workers)]
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_health(http, stop))
        t0 = time.perf_counter()
        await run_requests(http, slow, args.workers, (201, 202, 422))
        stop.set()
        h_lat, h_err, h_running = await poller
        rows.append(summary("healthz, every worker busy (cpsat)", h_lat, h_err,
                            time.perf_counter() - t0, 1) | {"max_running": max(h_running, default=0)})

        if args.renders:
            rows += await renders_vs_reads(http, args.renders, args.server_pid)
        rows += await hostile(http, args.server_pid)
        if args.budget_s:
            rows += await budgets(http, args.budget_s)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16, help=f"concurrent clients (at most {MAX_CLIENTS})")
    ap.add_argument("--requests", type=int, default=200, help=f"distinct plan requests (at most {MAX_REQUESTS})")
    ap.add_argument("--workers", type=int, default=2, help="server solver processes")
    ap.add_argument("--method", default="blocks", help="method of the uncached requests")
    ap.add_argument("--busy-s", type=float, default=4.0, help="cpsat time limit in the busy phase")
    ap.add_argument("--renders", type=int, default=48, help="concurrent first renders (0: skip)")
    ap.add_argument("--budget-s", type=float, default=5.0,
                    help="time limit for the 5000-layer x 4096-device method runs (0: skip)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "api_load.json"))
    args = ap.parse_args()
    args.clients = max(1, min(args.clients, MAX_CLIENTS))
    args.requests = max(1, min(args.requests, MAX_REQUESTS))

    with tempfile.TemporaryDirectory(prefix="pipeplan-bench-") as tmp:
        port = free_port()
        proc = start_server(Path(tmp) / "bench.db", port, args.workers, queue_size=args.requests + 16)
        try:
            args.server_pid = proc.pid
            rows = asyncio.run(bench(f"http://127.0.0.1:{port}", args))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)

    header = f"{'scenario':<44} {'requests':>8} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'req/s':>8} {'errors':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['scenario']:<44} {r['requests']:>8} {r['clients']:>7} {r['p50_ms']:>8.1f} "
              f"{r['p99_ms']:>8.1f} {r['max_ms']:>8.1f} {r['requests_per_s']:>8.1f} {r['errors']:>6}")
    base = {"scenario", "requests", "clients", "errors", "p50_ms", "p99_ms", "max_ms", "mean_ms",
            "requests_per_s"}
    for r in rows:
        extra = {k: v for k, v in r.items() if k not in base}
        if extra:
            print(f"  {r['scenario']}: " + ", ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={str(v)[:90]}" for k, v in extra.items()))
    result = {"command": " ".join(["benchmarks/api_load.py", *sys.argv[1:]]),
              "args": {k: v for k, v in vars(args).items() if k not in ("out", "server_pid")},
              "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_avg_1m": os.getloadavg()[0]},
              "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
