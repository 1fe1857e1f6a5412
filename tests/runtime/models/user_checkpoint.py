"""A user's model that checkpoints its blocks with torch.utils.checkpoint(use_reentrant=False):
its backward recomputes each block (ZB-H1 runs such a stage fused; split, W recomputes once more).
The model of reentrant_checkpoint.py beside it, with the other kind of checkpoint."""

from __future__ import annotations

import reentrant_checkpoint as base
from reentrant_checkpoint import loss_fn, make_batch  # noqa: F401 - the model file's interface
from torch import nn


class Block(base.Block):
    reentrant = False


def build_model() -> nn.Module:
    return base.build_model(Block)
