"""Shared helpers for the profiler tests: load an example with small sizes, run a partition
of a traced model as separate stages the way a pipeline does (values detached at every stage
boundary, gradients sent back and summed per tensor)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from profiler.graph import LayerGraph, build_stage
from profiler.loader import ModelFile, load_model_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SMALL_ENV = {
    "PIPEPLAN_MLP_BLOCKS": "3", "PIPEPLAN_MLP_DIM": "32", "PIPEPLAN_MLP_IN": "8",
    "PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_VOCAB": "128",
    "PIPEPLAN_GPT_SEQ": "8", "PIPEPLAN_UNET_DEPTH": "2", "PIPEPLAN_UNET_CH": "4",
    "PIPEPLAN_UNET_SIZE": "8",
}


def load_example(name: str, **env: str) -> ModelFile:
    """Load examples/<name>.py; module-level sizes are read from the environment at import."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return load_model_file(EXAMPLES / f"{name}.py")
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_pipeline(lg: LayerGraph, parts: list[list[str]], inputs: tuple[torch.Tensor, ...],
                 target: Any, loss_fn: Any) -> tuple[Any, torch.Tensor, dict[str, Any]]:
    """Forward and backward through separate stages; returns (output, loss, stages by index)."""
    stages = [build_stage(lg, p) for p in parts]
    values: dict[str, torch.Tensor] = {f"<input>:{i}": t for i, t in enumerate(inputs)}
    received: list[dict[str, torch.Tensor]] = []
    produced: list[dict[str, Any]] = []
    for st in stages:
        feed = {}
        for k in st.input_keys:
            v = values[k]
            if not k.startswith("<input>"):
                v = v.detach().requires_grad_(v.is_floating_point())
            feed[k] = v
        out = st(feed)
        received.append(feed)
        produced.append(out)
        values.update(out)
    output = produced[-1]["<output>"]
    loss = loss_fn(output, target)
    loss.backward()
    for s in range(len(stages) - 2, -1, -1):
        outs, grads = [], []
        for k, v in produced[s].items():
            if k == "<output>" or not isinstance(v, torch.Tensor) or not v.requires_grad:
                continue
            gs = [r[k].grad for r in received[s + 1:] if k in r and r[k].grad is not None]
            if gs:
                g = gs[0]
                for extra in gs[1:]:
                    g = g + extra
                outs.append(v)
                grads.append(g)
        if outs:
            torch.autograd.backward(outs, grads)
    return output, loss, {i: st for i, st in enumerate(stages)}
