"""`planner profile --tp`: every layer measured as it runs on one of t devices."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.formats import Profile

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt.py"


@pytest.fixture
def small_gpt(monkeypatch):
    for k, v in {"PIPEPLAN_GPT_BLOCKS": "2", "PIPEPLAN_GPT_DIM": "32", "PIPEPLAN_GPT_HEADS": "4",
                 "PIPEPLAN_GPT_VOCAB": "128", "PIPEPLAN_GPT_SEQ": "8", "PIPEPLAN_GPT_TIED": "0"}.items():
        monkeypatch.setenv(k, v)


def test_profile_tp_degrees(tmp_path, capsys, small_gpt):
    out = tmp_path / "p.json"
    assert main(["profile", str(GPT), "--batch-size", "2", "--tp", "2,4", "--warmup", "0",
                 "--repeats", "1", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "one of 2 devices" in printed and "one of 4 devices" in printed
    prof = Profile.model_validate(json.loads(out.read_text()))
    names = [layer.name for layer in prof.layers]
    assert names == ["tok_emb+pos_emb", "blocks.0", "blocks.1", "ln_f+head"]
    block, head = prof.layers[1], prof.layers[3]
    act = 2 * 8 * 32 * 4  # one (B, T, C) float32 activation: the block's input and output
    logits = 2 * 8 * 128 * 4
    for t in (2, 4):
        b = block.at_degree(t)
        assert b is not None
        # the linears are split t ways; LayerNorms and row-parallel biases stay whole
        assert block.param_bytes / t < b.param_bytes < block.param_bytes / t * 1.2
        # forward: attention and MLP outputs summed (two all-reduces of one activation);
        # backward: the inputs of q, k, v and the MLP's first linear (four)
        assert b.allreduce_bytes_fwd == 2 * act and b.allreduce_bytes_bwd == 4 * act
        h = head.at_degree(t)
        assert h is not None and h.allreduce_bytes_fwd == logits // 2  # the gathered logits
        assert b.fwd_ms > 0 and b.bwd_ms > 0
    # degree 1 is the layer itself
    assert block.at_degree(1).param_bytes == block.param_bytes  # type: ignore[union-attr]


@pytest.mark.parametrize(("tp", "message"), [("2", "no tensor-parallel plan"), ("0", "at least 2"),
                                             ("x", "separated by commas")])
def test_profile_tp_without_a_plan_is_a_clear_error_before_measuring(tmp_path, capsys, monkeypatch, tp, message):
    """Refused before any layer is measured (it was refused after measuring all of them)."""
    import profiler.profile

    def measured(*a, **k):
        raise AssertionError("the layers were measured before --tp was checked")
    monkeypatch.setattr(profiler.profile, "profile_model_file", measured)
    mlp = Path(__file__).resolve().parents[2] / "examples" / "mlp.py"
    rc = main(["profile", str(mlp), "--batch-size", "2", "--tp", tp, "--warmup", "0",
               "--repeats", "1", "-q", "-o", str(tmp_path / "p.json")])
    assert rc == 2
    assert message in capsys.readouterr().err
