"""Hugging Face causal LMs (tiny GPT-2 and Llama-style configs built here, no downloads) split
at their decoder blocks and train on 2 and 3 stages exactly like single-process training."""

from __future__ import annotations

import pytest
import torch
from conftest import traced_layers
from reference import max_abs_diff, reference_train
from runtime_paths import MODELS

pytest.importorskip("transformers")


@pytest.mark.parametrize("name,blocks", [("hf_gpt2", "transformer.h"), ("hf_llama", "model.layers")])
def test_one_layer_per_decoder_block(name, blocks):
    layers = traced_layers(MODELS / f"{name}.py")
    assert layers[1:-1] == [f"{blocks}.{i}" for i in range(4)]  # embeddings | blocks | norm + head
    assert layers[-1].endswith("lm_head")


@pytest.mark.parametrize("name,split,replicas", [
    ("hf_gpt2", [2, 2, 2], [1, 1, 1]),  # the tied embedding/head spans the first and last stage
    ("hf_gpt2", [3, 3], [1, 1]),
    ("hf_llama", [2, 2, 2], [1, 1, 1]),
    ("hf_llama", [3, 3], [2, 1]),
])
def test_trains_like_single_process(run, tmp_path, name, split, replicas):
    model = MODELS / f"{name}.py"
    plan = run.plan(model, split, replicas)
    rc, _, err, _ = run(plan, "--model", model, "--steps", 2, "--optimizer", "momentum",
                        "--save", tmp_path / "ck", "--timeout", 120)
    assert rc == 0, err
    ref = reference_train(str(model), 2, optimizer="momentum")
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < 1e-5
