"""Which signals the launcher takes over while its ranks run (`runtime.launch.stop_on_signals`)."""
from __future__ import annotations

import signal

from runtime import launch


def _restore(taken: dict) -> None:
    for sig, handler in taken.items():
        signal.signal(sig, handler)


def test_sigterm_and_sighup_stop_the_ranks_and_are_put_back() -> None:
    kept = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # (the suite may run under nohup)
    try:
        before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        taken = launch.stop_on_signals()
        try:
            assert set(taken) == {signal.SIGTERM, signal.SIGHUP}
            assert all(signal.getsignal(s) is launch._on_term for s in taken)
        finally:
            _restore(taken)
        assert {s: signal.getsignal(s) for s in before} == before
    finally:
        signal.signal(signal.SIGHUP, kept)


def test_an_ignored_sighup_stays_ignored() -> None:  # nohup
    old = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        taken = launch.stop_on_signals()
        _restore(taken)
        assert signal.SIGHUP not in taken and signal.SIGTERM in taken
    finally:
        signal.signal(signal.SIGHUP, old)


def test_a_handler_set_outside_python_is_left_to_it(monkeypatch) -> None:
    """`getsignal` is None for a handler Python did not install; putting None back raised a
    TypeError after the run."""
    real = signal.getsignal
    monkeypatch.setattr(signal, "getsignal", lambda s: None if s == signal.SIGHUP else real(s))
    taken = launch.stop_on_signals()
    _restore(taken)
    assert signal.SIGHUP not in taken and signal.SIGTERM in taken
