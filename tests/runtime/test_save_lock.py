"""The --save directory's lock (`runtime.checkpoint.lock_directory`) where the lock file cannot
be opened for writing: another user's, in a directory both write (the suite runs as root, which
no mode stops, so the refusal is the kernel's answer replayed)."""
from __future__ import annotations

import os

import pytest

from planner.errors import PipeplanError
from runtime.checkpoint import LOCK_FILE, lock_directory


def test_another_user_s_lock_file_is_locked_read_only(tmp_path, monkeypatch) -> None:
    (tmp_path / LOCK_FILE).write_text("12345")  # left by another user's run (mode 0644, theirs)
    real_open = os.open

    def refused(path, flags, *mode):
        if str(path).endswith(LOCK_FILE) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *mode)

    monkeypatch.setattr(os, "open", refused)
    fd = lock_directory(tmp_path)  # raised PermissionError: a traceback before any rank started
    assert fd is not None
    try:
        monkeypatch.setattr(os, "open", real_open)
        with pytest.raises(PipeplanError, match="another run"):  # and it is held
            lock_directory(tmp_path)
    finally:
        os.close(fd)


def test_a_directory_that_cannot_take_the_lock_file_runs_unlocked(tmp_path, monkeypatch) -> None:
    def refused(path, flags, *mode):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(os, "open", refused)
    assert lock_directory(tmp_path / "ck") is None
