"""A tiny Llama-style causal LM from Hugging Face `transformers` (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU; random weights from a config: no download)."""

import torch
import transformers

VOCAB = 64


def build_model() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, use_cache=False,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(cfg)


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, 9))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(out, target: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    return torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), target.reshape(-1))
