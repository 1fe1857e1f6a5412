"""Which device and backend a rank takes (`runtime.worker._device`), for the ways ranks are
started: our launcher, torchrun, or a launcher of the user's that shows each process one GPU.
torch.cuda is replaced by a fake: no GPU is needed, and none is touched."""
from __future__ import annotations

import pytest
import torch

from planner.errors import PipeplanError
from runtime.launch import LAUNCHER_PID_ENV
from runtime.worker import DistEnv, _device


@pytest.fixture
def gpus(monkeypatch):
    chosen: list[int] = []

    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: chosen.append(int(i)))
    for var in (LAUNCHER_PID_ENV, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    visible.chosen = chosen  # type: ignore[attr-defined]
    return visible


def env(local_rank: int, local_world: int) -> DistEnv:
    return DistEnv(rank=local_rank + 8, world_size=16, local_rank=local_rank, local_world_size=local_world)


@pytest.mark.parametrize("launcher", [LAUNCHER_PID_ENV, "TORCHELASTIC_RUN_ID", None])
def test_a_gpu_per_local_rank_is_that_rank_s(gpus, monkeypatch, launcher) -> None:
    gpus(8)
    if launcher:
        monkeypatch.setenv(launcher, "1")
    assert _device(env(3, 8)) == (torch.device("cuda", 3), "nccl")
    assert gpus.chosen == [3]


def test_one_gpu_shown_to_each_process_is_its_own(gpus, monkeypatch) -> None:
    """srun --gpus-per-task=1: each of the node's 8 processes sees one device, its own; they
    trained on the CPU before."""
    gpus(1)
    monkeypatch.setenv("SLURM_GPUS_PER_TASK", "1")
    assert _device(env(5, 8)) == (torch.device("cuda", 0), "nccl")
    assert gpus.chosen == [0]


def test_one_gpu_seen_by_ranks_started_by_hand_is_not_taken_by_all(gpus, monkeypatch, capsys) -> None:
    """Ranks a user's own launcher starts (RANK, WORLD_SIZE set by hand) on a one-GPU machine all
    see the same GPU: NCCL would stop at its start ("Duplicate GPU detected"); the CPU, warned."""
    gpus(1)
    monkeypatch.delenv("SLURM_GPUS_PER_TASK", raising=False)
    assert _device(env(0, 4)) == (torch.device("cpu"), "gloo")
    assert "every rank runs on the CPU" in capsys.readouterr().err


def test_our_launcher_on_fewer_gpus_than_ranks_runs_on_the_cpu(gpus, monkeypatch, capsys) -> None:
    gpus(1)  # every rank our launcher starts sees the same GPU: they cannot all use it
    monkeypatch.setenv(LAUNCHER_PID_ENV, "1")
    assert _device(env(0, 4)) == (torch.device("cpu"), "gloo")
    assert "every rank runs on the CPU" in capsys.readouterr().err
    assert gpus.chosen == []


@pytest.mark.parametrize("count", [1, 4])
def test_torchrun_on_fewer_gpus_than_ranks_is_refused(gpus, monkeypatch, count) -> None:
    """Its ranks would take gloo where other nodes' take NCCL: a group that never forms."""
    gpus(count)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    with pytest.raises(PipeplanError, match=f"8 ranks on this node but {count} GPU.*--nproc-per-node {count}"):
        _device(env(0, 8))


def test_no_gpu_is_the_cpu(gpus, monkeypatch) -> None:
    gpus(0)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert _device(env(0, 8)) == (torch.device("cpu"), "gloo")


def test_torchrun_on_one_node_with_fewer_gpus_than_ranks_runs_on_the_cpu(gpus, monkeypatch, capsys) -> None:
    """One node: every rank chooses gloo alike, the group forms (torchrun --nnodes 1
    --nproc-per-node 2 on a one-GPU machine trained on the CPU before; the suite's own torchrun
    tests do this)."""
    gpus(1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    one_node = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2)
    assert _device(one_node) == (torch.device("cpu"), "gloo")
    assert gpus.chosen == []
