"""A tiny Hugging Face GPT-2 (random weights, built from a config: no download); dropout off so
training is deterministic. Its head is tied to the token embedding."""

import torch
import transformers

VOCAB = 64


def build_model() -> torch.nn.Module:
    cfg = transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, use_cache=False,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, 9))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), target.reshape(-1))
