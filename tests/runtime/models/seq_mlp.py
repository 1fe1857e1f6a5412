"""A tiny sequential MLP for the runtime tests.

PIPEPLAN_TEST_FAULT=<kind>:<rank> makes the run fail on purpose in that rank's second layer's
forward: `raise` (an exception), `die` (the process vanishes), `exit0` (it vanishes with status 0)
`hang` (sleeps for ever), `sigint` (sends itself SIGINT, Ctrl-C), `child-raise` (starts `sleep 600`, writes its pid to
PIPEPLAN_TEST_CHILD_PID, raises) or `child` (the same once, and trains on); or,
`import-hang`, while that rank imports this file (before it joins the process group); or
`trace-hang:any`, in every process's forward without gradients (the one that traces the model;
it creates the file PIPEPLAN_TEST_HANG_MARK names, if set, as it starts to hang).
PIPEPLAN_TEST_FREEZE=<i>,<j>,... freezes (requires_grad=False) the parameters of those layers.
"""

import os
import time

import torch
from torch import nn

if os.environ.get("PIPEPLAN_TEST_FAULT", "").partition(":")[::2] == ("import-hang", os.environ.get("RANK")):
    time.sleep(3600)


_CHILDREN: list = []  # fault `child`: the one process this rank started


class Faulty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind, _, rank = os.environ.get("PIPEPLAN_TEST_FAULT", "::").partition(":")
        if kind == "trace-hang" and not torch.is_grad_enabled():
            if os.environ.get("PIPEPLAN_TEST_HANG_MARK"):  # the test sees the hang begin
                open(os.environ["PIPEPLAN_TEST_HANG_MARK"], "w").close()
            time.sleep(3600)
        # only while training (grad enabled), not while the model is traced
        if rank and os.environ.get("RANK") == rank and torch.is_grad_enabled():
            if kind == "raise":
                raise ValueError("deliberate failure in Faulty.forward")
            if kind == "die":
                os._exit(17)
            if kind == "exit0":
                os._exit(0)
            if kind == "hang":
                time.sleep(3600)
            if kind == "sigint":  # Ctrl-C reaching this rank alone (torchrun passes it on to all)
                import signal

                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(60)
            if kind == "child" and not _CHILDREN:  # a process of its own, left running
                import subprocess

                _CHILDREN.append(subprocess.Popen(["sleep", "600"]))
                with open(os.environ["PIPEPLAN_TEST_CHILD_PID"], "w") as f:
                    f.write(str(_CHILDREN[0].pid))
            if kind == "child-raise":  # a process of its own left running, then an error
                import subprocess

                child = subprocess.Popen(["sleep", "600"])
                with open(os.environ["PIPEPLAN_TEST_CHILD_PID"], "w") as f:
                    f.write(str(child.pid))
                raise ValueError("deliberate failure after starting a child process")
        return torch.tanh(self.lin(x))


def build_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), Faulty(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 4))
    for i in filter(None, os.environ.get("PIPEPLAN_TEST_FREEZE", "").split(",")):
        model[int(i)].requires_grad_(False)
    return model


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    return (torch.randn(batch_size, 8),), torch.randn(batch_size, 4)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()
