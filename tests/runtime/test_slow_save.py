"""A checkpoint that takes longer to write than --timeout: the other ranks wait on rank 0's
progress, not on a clock, so a slow but moving write finishes the run (it failed as "rank 0
hangs"), and a write that stopped still fails, naming rank 0 and the checkpoint, never hanging.

The slow file system is real: the checkpoint's model file is a named pipe (`model.pt.tmp`, the
name `checkpoint.save` writes before renaming), read by a thread of the test at ~1.3 MB/s, or
never opened by anyone (a write that blocks as on a file system that stopped answering)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from reference import max_abs_diff, reference_train

from runtime import progress

WIDE = """
import torch
from torch import nn
def build_model():
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)])   # 4.2 MB of weights
def make_batch(n):
    return (torch.randn(n, 512),), torch.randn(n, 512)
def loss_fn(out, y):
    return ((out - y) ** 2).mean()
"""


def _slow_reader(fifo: Path, into: Path) -> threading.Thread:
    def read() -> None:
        with open(fifo, "rb") as f, open(into, "wb") as out:
            while chunk := f.read(1 << 16):
                out.write(chunk)
                time.sleep(0.05)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_save_slower_than_the_timeout_finishes_while_it_makes_progress(run, tmp_path):
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    plan = run.plan(model, 2)
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / "model.pt.tmp")
    reader = _slow_reader(ck / "model.pt.tmp", tmp_path / "got.pt")
    t0 = time.time()
    rc, _, err, wall = run(plan, "--model", model, "--steps", 2, "--save", ck, "--timeout", 2)
    reader.join(30)
    assert rc == 0, err
    assert wall > 3.5, wall  # the write itself took longer than --timeout (4.2 MB at ~1.3 MB/s)
    ref = reference_train(str(model), 2)
    assert max_abs_diff(ref, torch.load(tmp_path / "got.pt")) < 1e-5
    assert time.time() - t0 < 60


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes")
def test_a_save_that_stopped_fails_naming_rank_0(run, tmp_path):
    model = tmp_path / "wide.py"
    model.write_text(WIDE)
    plan = run.plan(model, 2)
    ck = tmp_path / "ck"
    ck.mkdir()
    os.mkfifo(ck / "model.pt.tmp")  # nobody reads: rank 0's open() blocks for ever
    rc, out, err, wall = run(plan, "--model", model, "--steps", 3, "--save", ck, "--save-every", 1,
                             "--timeout", 2)
    assert rc != 0 and "step 1: loss" in out
    assert "writing the checkpoint of step 1" in err and "rank 0 wrote nothing for 2 s" in err, err
    assert "Traceback" not in err
    assert wall < 40, wall


def test_wait_for_goes_on_while_the_count_moves_and_stops_when_it_stands():
    """The waiting side alone, against a real store: a count that moves every 0.3 s keeps a
    0.5 s timeout from firing for 1.5 s; one that stops fires it; the outcome is passed on."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    counter = progress.Counter()

    def write(stall_after: int) -> None:
        with progress.heartbeat(store, f"k{stall_after}", counter):
            for i in range(5):
                time.sleep(0.3)
                if i < stall_after:
                    counter.add(1)
                else:
                    time.sleep(2)  # stands still for longer than the waiter's timeout

    t = threading.Thread(target=write, args=(5,))
    t.start()
    t0 = time.time()
    assert progress.wait_for(store, "k5", 0.5, "writing") == "ok"
    assert time.time() - t0 > 1.4
    t.join()

    t = threading.Thread(target=write, args=(2,))
    t.start()
    with pytest.raises(progress.PeerError, match="rank 0 wrote no more than its 7 bytes for 0.5 s"):
        progress.wait_for(store, "k2", 0.5, "writing")
    t.join()


def test_the_copy_that_keeps_the_previous_checkpoint_counts_as_progress(tmp_path, monkeypatch):
    """Where the file system refuses hard links (SMB, exFAT, s3fs: an outside review), the save
    keeps the previous checkpoint by copying it, as long as the new one takes to write; its
    bytes were not counted, so the waiting ranks took rank 0 for stuck."""
    from runtime import checkpoint

    state = {"w": torch.randn(300_000)}
    checkpoint.save(tmp_path, state, {}, {"step": 1})
    before = sum((tmp_path / n).stat().st_size for n in checkpoint.FILES)

    def refuse(src, dst):  # noqa: ANN001, ANN202
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", refuse)
    counter = progress.Counter()
    checkpoint.save(tmp_path, state, {}, {"step": 2}, counter=counter)
    written = sum((tmp_path / n).stat().st_size for n in (checkpoint.MODEL_FILE, checkpoint.OPTIMIZER_FILE))
    assert counter.value >= written + before - (tmp_path / checkpoint.META_FILE).stat().st_size
    assert checkpoint.load(tmp_path)[2]["step"] == 2
