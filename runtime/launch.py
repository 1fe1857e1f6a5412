"""Start one process per rank of a plan on this machine and wait for them (a small torchrun).

Each child is `python -m runtime <same arguments>` with the standard torch.distributed
environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1,
MASTER_PORT) — exactly what torchrun sets, including torchrun's way of hosting the rendezvous
store in the launcher (TORCHELASTIC_USE_AGENT_STORE; the launcher's store binds its port
itself, so no other process can take the port between choosing and using it) — plus
PIPEPLAN_ERROR_FILE, where a failing rank writes its error, and PIPEPLAN_LAUNCHER_PID: a rank
ends when the launcher dies (`die_with_launcher`). When any rank fails, the others are stopped
at once and the error of the rank that failed first on its own (not because a peer went away)
is returned. Where every failure so far is a peer's (a rank timed out or lost its connection
waiting for another), the others get up to `peer_wait_s` (the run's --timeout) to report too
before they are stopped: a rank that waits for a rank that hangs names the wrong one, the rank
it waited for, which itself only waited for the one that hangs. A rank that neither finished
nor reported an error by then is reported first, as the rank that hangs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import argparse

ERROR_FILE_ENV = "PIPEPLAN_ERROR_FILE"
LAUNCHER_PID_ENV = "PIPEPLAN_LAUNCHER_PID"  # the launcher a rank must not outlive
_GRACE_S = 1.0  # after a failure, how long the other ranks get to write their own errors


@dataclass
class Failure:
    rank: int
    exit_code: int
    kind: str  # "user" | "error" | "peer" | "crash" | "hang"
    message: str
    peer: int | None = None  # kind "peer": the rank it waited for


def _read_error(path: Path, rank: int, code: int) -> Failure:
    try:
        data = json.loads(path.read_text())
        peer = data.get("peer")
        return Failure(rank, code, data["kind"], data["message"], peer if isinstance(peer, int) else None)
    except (OSError, ValueError, KeyError):
        how = (f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
               + (" before finishing its steps (os._exit(0) or a similar exit in the model's "
                  "code?)" if code == 0 else ""))
        return Failure(rank, code, "crash", f"rank {rank} {how} without reporting an error")


def finished(error_file: str | None) -> None:
    """In a rank this launcher started, right before its normal exit: the mark that tells a
    rank that finished from one that exited with status 0 before its work was done (an
    `os._exit(0)` in the model's code, which counted as success)."""
    if error_file is not None:
        _done_file(Path(error_file)).touch()


def _done_file(error_file: Path) -> Path:
    """Where a rank whose error file is `error_file` marks its normal exit (`finished`)."""
    return error_file.with_suffix(".done")


INTERRUPTED = "interrupted (SIGINT)"  # a rank's report of Ctrl-C


def as_rank(main: Callable[[argparse.Namespace, str | None], int], args: argparse.Namespace,
            error_file: str | None) -> int:
    """Run a rank's `main`; Ctrl-C before it could report (while importing torch: `main`
    reports the rest itself, `worker.end_rank`) ends the rank in one line, status 130."""
    try:
        return main(args, error_file)
    except KeyboardInterrupt:
        print(f"error: rank {os.environ.get('RANK', '?')}: {INTERRUPTED}", file=sys.stderr, flush=True)
        os._exit(130)


class Terminated(KeyboardInterrupt):
    """The launcher got SIGTERM or SIGHUP (a closed terminal or ssh session): its ranks are
    stopped as on Ctrl-C; it exits 128 + the signal (143, 129), not 130."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signum)
        self.signum = int(signum)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


def _on_term(signum: int, frame: object) -> None:
    raise Terminated(signum)


def stop_on_signals() -> dict[int, object]:
    """In the main thread: SIGTERM and SIGHUP raise `Terminated` from now on; the handlers they
    had (to put back), {} elsewhere. SIGHUP too (a closed terminal or ssh session): its default
    action ended the launcher at once, the ranks then by their parent-death signal, but what
    they started (a data loader's workers, a subprocess of the model file) lived on and the
    launcher's temporary folders stayed in /tmp. A SIGHUP ignored (nohup) stays ignored, and a
    signal whose handler was set outside Python (`getsignal` None: it could not be put back) is
    left to it."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    taken = {}
    for sig in [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []):
        now = signal.getsignal(sig)
        if now is None or (sig != signal.SIGTERM and now is signal.SIG_IGN):
            continue
        taken[sig] = signal.signal(sig, _on_term)
    return taken


def put_back(taken: dict[int, object]) -> None:
    """The handlers `stop_on_signals` replaced, back in place."""
    for sig, handler in taken.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


def report_terminated(exc: Terminated, ranks_stopped: bool) -> int:
    """One line for a launcher stopped by SIGTERM / SIGHUP (printing may fail on a hung-up
    terminal: EIO), and its exit status, 128 + the signal as a shell reports it."""
    with contextlib.suppress(OSError):
        print(f"terminated ({exc.name})" + (": the ranks were stopped" if ranks_stopped else ""),
              file=sys.stderr)
    return 128 + exc.signum


def die_with_launcher() -> None:
    """In a rank this launcher started: ask Linux to end it (SIGTERM) when the launcher dies,
    and end now if it already has. The ranks' connections to each other outlive the
    launcher's store, so a launcher killed outright (SIGKILL, an OOM kill, a closed session)
    left them training for nobody, holding the cores. Elsewhere (torchrun, other systems)
    nothing changes. (Linux signals when the *thread* that started the rank ends: `launch`
    waits for its ranks in that thread, so that is when the launcher is done with them.)"""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid and "TORCHELASTIC_RUN_ID" in os.environ:
        # under torchrun the agent is the rank's parent: a node's agent killed outright left its
        # ranks training on for the other nodes to the end (an outside review: SIGKILL to one
        # node's agent, and its orphaned rank finished 4000 steps with the other node's)
        pid = str(os.getppid())
        if pid == "1":
            pid = "0"  # reparented already: the agent is gone (the check below stops the rank)
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(pid):  # the launcher died before the request took effect
        print(f"error: rank {os.environ.get('RANK', '?')}: its launcher (pid {pid}, torchrun's agent "
              "where torchrun started it) has exited; "
              "stopping", file=sys.stderr, flush=True)
        os._exit(1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (for scripts that start their own ranks; the
    launcher itself lets its store bind port 0, which cannot race)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _signal_group(p: subprocess.Popen, sig: int) -> bool:
    """`sig` to the rank's process group (its own, `launch` starts it so): the rank and whatever
    it started (a data loader's workers, a `subprocess` of the model file); False where the
    group is gone (signal 0: whether any of it is left)."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stop(procs: list[subprocess.Popen]) -> None:
    """Stop every rank and every process it started: SIGTERM, and SIGKILL to what is left of
    each group after 3 s (a rank's child outlived a failed run before, holding the caller's
    pipe: `python -m runtime ... | tail` waited for it; an outside review). Ranks that have
    exited already leave only their children to stop."""
    for p in procs:
        if os.name == "posix":
            _signal_group(p, signal.SIGTERM)  # the rank leads its group
        elif p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + 3.0
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    if os.name == "posix":
        left = [p for p in procs if _signal_group(p, 0)]
        if left:
            time.sleep(0.2)  # children that end on SIGTERM
            for p in left:
                _signal_group(p, signal.SIGKILL)



def _hung(failures: list[Failure], alive: list[int]) -> list[Failure]:
    """Where every failure is a peer's and some ranks are still running: those ranks, as
    hanging (the ones other ranks named first), each with the error that named it, if any."""
    if not alive or any(f.kind != "peer" for f in failures):
        return []
    named = {f.peer: f for f in reversed(failures) if f.peer is not None}
    out = []
    for r in sorted(alive, key=lambda r: (r not in named, r)):
        why = f" (first: {named[r].message})" if r in named else ""
        out.append(Failure(r, 0, "hang", f"rank {r} hangs: it neither finished nor reported an "
                                         f"error while the ranks waiting for it timed out{why}"))
    return out


# what a rank holds before any model: Python, torch, gloo, its messages' buffers (an outside
# review measured the machine's used memory grow by 245-300 MB per calibrate rank with 8-64
# ranks: at 150 MB, 120 ranks passed this check and took 22 of 23.5 GB)
RANK_BYTES = 320 * 2**20


def available_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_room(world_size: int, what: str) -> None:
    """Refuse, before any process starts, a number of local ranks this machine cannot hold:
    each is a Python process with torch (`RANK_BYTES` before any model). Raises PipeplanError."""
    from planner.errors import PipeplanError

    free = available_memory_bytes()
    if free is not None and world_size * RANK_BYTES > free:
        most = max(1, free // RANK_BYTES)
        raise PipeplanError(
            f"{what} needs {world_size} rank processes on this machine; each holds about "
            f"{RANK_BYTES / 2**20:.0f} MB before any model and {free / 2**30:.1f} GB is available, "
            f"enough for about {most}: start it on its machines with torchrun, or use fewer ranks")


def local_store() -> object:
    """The launcher's rendezvous store, listening on 127.0.0.1 only: given a host alone,
    TCPStore's server listens on every interface (*:PORT), so any machine on the network could
    read and set the keys of a local run (unauthenticated); a socket bound here and handed over
    (`master_listen_fd`) cannot be taken by another process between choosing the port and using
    it either. The store gets a duplicate of the socket, which it owns and closes; ours closes
    here. TCPStore's libuv server (the default from torch 2.4) takes a listening socket only
    from pytorch/pytorch#150215 on: before, it refused one (NotImplementedError, after an error
    line in the log), and the store fell back to every interface; the legacy server takes one
    in every version."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.torch_version import TorchVersion

    legacy = {} if TorchVersion(torch.__version__) >= (2, 8) else {"use_libuv": False}
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        fd = os.dup(listener.fileno())
        try:
            return dist.TCPStore("127.0.0.1", listener.getsockname()[1], is_master=True,
                                 wait_for_workers=False, master_listen_fd=fd, **legacy)
        except (TypeError, RuntimeError, ValueError):  # a torch without master_listen_fd: as before
            with contextlib.suppress(OSError):
                os.close(fd)
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def launch(argv: list[str], world_size: int, threads: int | None = None,
           peer_wait_s: float = 0.0) -> list[Failure]:
    """Run `python -m runtime *argv` on `world_size` local ranks (`threads` torch threads each;
    None: the cores / the ranks); the failures, most telling first (empty when every rank
    succeeded). `peer_wait_s`: how long the others may take to report where every failure so
    far is a peer's (module doc)."""
    store = local_store()
    port = store.port
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="pipeplan-run-") as tmp:
        error_files = [Path(tmp) / f"rank{rank}.json" for rank in range(world_size)]
        procs: list[subprocess.Popen] = []
        previous = stop_on_signals()  # stop the ranks too when the launcher is told to stop
        try:
            for rank in range(world_size):  # (a signal while starting them stops those started)
                env = dict(os.environ)
                env.update({
                    "RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "TORCHELASTIC_USE_AGENT_STORE": "True",
                    "OMP_NUM_THREADS": str(threads),
                    ERROR_FILE_ENV: str(error_files[rank]),
                    LAUNCHER_PID_ENV: str(os.getpid()),
                })
                # each rank leads a process group of its own, which `_stop` ends whole (Ctrl-C
                # reaches the launcher, which stops them, as SIGTERM does)
                procs.append(subprocess.Popen([sys.executable, "-m", "runtime", *argv], env=env,
                                              start_new_session=os.name == "posix"))
            failed_at = None
            told = False
            seen: dict[int, Failure] = {}  # each exited rank's error, read once
            while True:
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    if all(_done_file(f).exists() for f in error_files):
                        _stop(procs)  # what the ranks started and left running
                        return []
                    break  # one exited 0 before finishing its steps
                if any(c not in (None, 0) for c in codes):
                    failed_at = failed_at or time.time()
                    if all(c is not None for c in codes):
                        break
                    if time.time() - failed_at > _GRACE_S:
                        for r, c in enumerate(codes):
                            if c not in (None, 0) and r not in seen:
                                seen[r] = _read_error(error_files[r], r, c)
                        so_far = list(seen.values())
                        if time.time() - failed_at > _GRACE_S + peer_wait_s or \
                                any(f.kind != "peer" for f in so_far):
                            break
                        if not told:
                            told = True
                            print(f"{so_far[0].message}; waiting up to {peer_wait_s:g} s for the other "
                                  "ranks to report, to name the rank that hangs", file=sys.stderr,
                                  flush=True)
                time.sleep(0.02)
        except KeyboardInterrupt:
            _stop(procs)
            raise
        finally:
            put_back(previous)
        # a rank that exited 0 without finishing (no .done file) failed too
        own = {r: p.returncode for r, p in enumerate(procs) if p.returncode not in (0, None)
               or (p.returncode == 0 and not _done_file(error_files[r]).exists())}
        alive = [r for r, p in enumerate(procs) if p.poll() is None]
        _stop(procs)  # the rest: stopped by us, their exit says nothing
        failures = [_read_error(error_files[r], r, code) for r, code in own.items()]
        files = {f.rank: error_files[f.rank] for f in failures}
        order = {"user": 0, "error": 0, "crash": 1, "peer": 2}

        def when(f: Failure) -> float:
            try:
                return float(json.loads(files[f.rank].read_text())["time"])
            except (OSError, ValueError, KeyError):
                return float("inf")

        failures.sort(key=lambda f: (order.get(f.kind, 3), when(f)))
        return _hung(failures, alive) + failures if peer_wait_s > 0 else failures
