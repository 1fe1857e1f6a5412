"""Waiting on one rank's long write without a fixed time limit: rank 0 writing a checkpoint.

Every other wait between ranks has a limit, --timeout: a peer that answers in none is taken for
dead or hung. A checkpoint is different: rank 0 writes the whole model and optimizer state while
the others wait, and on a large model or a slow (network) file system that takes as long as it
takes: minutes past any --timeout chosen for the pipeline's messages. Waiting on it under that
limit failed a healthy run ("rank 0 hangs"); waiting without one would hold the job for ever
where the write is stuck (a file system that stopped answering).

So the wait is on progress, not on time: rank 0 counts the bytes its save has written
(`Counter`, fed by `checkpoint.save`) and publishes the count in the job's store while it
writes (`Heartbeat`); the others (`wait_for`) wait as long as the count moves and fail, naming
rank 0 and the checkpoint, once it has stood still for --timeout. A rank 0 that dies is the
launcher's to report (the store lives in the launcher, or torchrun's agent), as for any rank.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from planner.errors import describe
from runtime.comm import PeerError

BEAT = "/beat"  # the bytes written so far (a decimal count)
DONE = "/done"  # "ok", or why the write failed


class Counter:
    """Bytes written so far, added to by the writing thread and read by the heartbeat's."""

    def __init__(self) -> None:
        self.value = 0

    def add(self, n: int) -> None:
        self.value += n  # (one writer: an int's += is atomic enough for a reader that only polls)


class Heartbeat:
    """Rank 0's side: publish `counter` under `key + BEAT` every `period_s` until `done`."""

    def __init__(self, store: object, key: str, counter: Counter, period_s: float = 0.5) -> None:
        self._store, self._key, self._counter = store, key, counter
        self._stop = threading.Event()
        self._store.set(key + BEAT, "0")  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._beat, args=(period_s,),
                                        name="pipeplan-save-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            try:
                self._store.set(self._key + BEAT, str(self._counter.value))  # type: ignore[attr-defined]
            except Exception:  # noqa: BLE001  (the store gone: the launcher is; nothing to tell)
                return

    def done(self, outcome: str) -> None:
        self._stop.set()
        self._thread.join()
        self._store.set(self._key + DONE, outcome)  # type: ignore[attr-defined]


@contextmanager
def heartbeat(store: object | None, key: str, counter: Counter) -> Iterator[None]:
    """Beat while the block runs; its end (or its exception) is published as DONE."""
    if store is None:
        yield
        return
    beat = Heartbeat(store, key, counter)
    try:
        yield
    except BaseException as exc:
        try:
            beat.done(f"failed: {describe(exc, 200)}")
        except Exception:  # noqa: BLE001  (the store gone: the write's own error is the one to tell)
            pass
        raise
    beat.done("ok")


def wait_for(store: object, key: str, timeout_s: float, what: str, writer: int = 0,
             poll_s: float = 0.5) -> str:
    """The other ranks' side: wait until `writer` publishes DONE under `key` (its outcome is
    returned), as long as its count moves; a PeerError naming it once the count has stood still
    (or never appeared) for `timeout_s`."""
    last: str | None = None
    since = time.monotonic()
    polls = 0
    try:
        while True:
            # (polled, at first often, then every `poll_s`: the store's own timed wait logs a
            # warning on each timeout, and a thousand ranks polling often would swamp it)
            if store.check([key + DONE]):  # type: ignore[attr-defined]
                return store.get(key + DONE).decode()  # type: ignore[attr-defined]
            beat = store.get(key + BEAT).decode() if store.check([key + BEAT]) else None  # type: ignore[attr-defined]
            now = time.monotonic()
            if beat != last:
                last, since = beat, now
            elif now - since > timeout_s:
                wrote = "nothing" if beat in (None, "0") else f"no more than its {int(beat):,} bytes"
                raise PeerError(writer, f"{what}: rank {writer} wrote {wrote} for {timeout_s:g} s "
                                        "(--timeout): its file system stopped answering, or the "
                                        "rank hangs; a write that is only slow goes on as long "
                                        "as it writes")
            time.sleep(min(poll_s, 0.01 * 1.5 ** polls))
            polls += 1
    except PeerError:
        raise
    except Exception as exc:  # noqa: BLE001  (the store's connection lost: the launcher is gone)
        raise PeerError(writer, f"{what}: the job's store failed ({describe(exc, 200)}); the "
                                "launcher has stopped") from None
