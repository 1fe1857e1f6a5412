"""A GPT-2 from `transformers` (small config, random weights, no download) traces at block
granularity and its stages reproduce it; skipped when transformers is not installed."""

from __future__ import annotations

import pytest
import torch
from profiler_helpers import run_pipeline

from profiler.graph import trace

transformers = pytest.importorskip("transformers")


def _gpt2(n_layer: int = 2) -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=n_layer, n_embd=32, n_head=2, vocab_size=96, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def _loss(out, target):
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), target.reshape(-1))


def test_gpt2_traces_into_embedding_blocks_head_and_stages_match() -> None:
    torch.manual_seed(0)
    ref = _gpt2(3)
    torch.manual_seed(0)
    model = _gpt2(3)
    tokens = torch.randint(0, 96, (2, 13))
    inputs, target = (tokens[:, :-1],), tokens[:, 1:]
    lg = trace(model, inputs, granularity="blocks")
    names = lg.layer_names()
    assert names[1:4] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert "transformer.wte" in names[0].split("+") and names[-1].endswith("lm_head")
    # the stage calls the model's own block objects (not a trace of their code)
    from profiler.graph import build_stage
    assert build_stage(lg, names[1:2]).get_submodule("transformer.h.0") is model.transformer.h[0]
    # the head is tied to the token embedding: reported as shared between first and last layer
    assert any({"transformer.wte.weight", "lm_head.weight"} & set(s.keys) and s.layers == [names[0], names[-1]]
               for s in lg.shared_parameters)
    ref_out = ref(*inputs)
    _loss(ref_out, target).backward()
    ref_grads = dict(ref.named_parameters(remove_duplicate=False))
    out, _, stages = run_pipeline(lg, [names[:2], names[2:]], inputs, target, _loss)
    assert torch.equal(out.logits, ref_out.logits)
    for st in stages.values():
        for k, p in st.named_parameters(remove_duplicate=False):
            assert torch.equal(p.grad, ref_grads[k].grad), k


def test_gpt2_model_file_profiles_at_block_granularity(tmp_path) -> None:
    from profiler.profile import profile_model_file

    path = tmp_path / "gpt2_model.py"
    path.write_text(
        "import torch, transformers\n"
        "def build_model():\n"
        "    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32,\n"
        "        use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)\n"
        "    return transformers.GPT2LMHeadModel(cfg)\n"
        "def make_batch(n):\n"
        "    t = torch.randint(0, 96, (n, 17))\n"
        "    return (t[:, :-1],), t[:, 1:]\n"
        "def loss_fn(out, y):\n"
        "    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, 96), y.reshape(-1))\n"
    )
    profile = profile_model_file(path, 2, warmup=0, repeats=1)
    names = [layer.name for layer in profile.layers]
    assert names[1:3] == ["transformer.h.0", "transformer.h.1"] and len(names) == 4
    assert profile.trace_method == "export"
    block_params = sum(p.numel() * 4 for p in transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=96, n_positions=32)
    ).transformer.h[0].parameters())
    assert profile.layers[1].param_bytes == block_params
    assert all(layer.activation_bytes > 0 for layer in profile.layers[1:])
    assert profile.edges[-1].bytes == 2 * 16 * 32 * 4  # hidden states into the head
