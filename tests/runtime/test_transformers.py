"""Hugging Face causal LMs (tiny GPT-2 and Llama-style configs built here, no downloads) split
at their decoder blocks and train on 2 and 3 stages exactly like single-process training."""

from __future__ import annotations

import pytest
import torch
from plans import traced_layers
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
    # (Llama on 3 stages: test_profile_plan_run_llama_end_to_end)
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


def test_profile_plan_run_llama_end_to_end(run, tmp_path):
    # the real commands: profile at the default granularity, plan 3 stages, train
    from planner.cli import main as planner_main

    model = MODELS / "hf_llama.py"
    cluster = tmp_path / "cluster.json"
    cluster.write_text('{"nodes": 1, "devices_per_node": 3, "device_memory_gb": 1, '
                       '"intra_node_gb_per_s": 10, "inter_node_gb_per_s": 1}')
    assert planner_main(["profile", str(model), "--batch-size", "2", "--warmup", "0", "--repeats", "1",
                         "-q", "-o", str(tmp_path / "profile.json")]) == 0
    assert planner_main(["plan", str(tmp_path / "profile.json"), "--cluster", str(cluster),
                         "--method", "manual", "--split", "2,2,2", "--replicas", "1,1,1",
                         "--global-batch", "8", "--microbatch-size", "2", "--optimizer", "momentum",
                         "-o", str(tmp_path / "plan.json")]) == 0
    rc, _, err, _ = run(tmp_path / "plan.json", "--model", model, "--steps", 2,
                        "--save", tmp_path / "ck", "--timeout", 120)
    assert rc == 0, err
    ref = reference_train(str(model), 2, optimizer="momentum")
    assert max_abs_diff(ref, torch.load(tmp_path / "ck" / "model.pt")) < 1e-5
