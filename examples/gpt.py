"""A GPT-style decoder: token + position embedding, N pre-norm transformer blocks with causal
self-attention, final LayerNorm and a vocabulary head. As in real language models, the first
layer (embeddings) and the last (norm + head) carry far more parameters than one block.

Sizes from the environment: PIPEPLAN_GPT_BLOCKS (4), PIPEPLAN_GPT_DIM (64),
PIPEPLAN_GPT_HEADS (4), PIPEPLAN_GPT_VOCAB (2048), PIPEPLAN_GPT_SEQ (32); PIPEPLAN_GPT_TIED=1
ties the head's weight to the token embedding. No dropout: training is deterministic.

Tensor-parallel ready (`tp_plan`): q/k/v are separate projections (column-parallel), the number
of heads is read from the local shard's width, the token embedding and the head are split over
the vocabulary. Tied weights and tensor parallelism do not go together here.
"""

import os

import torch
from torch import nn
from torch.nn import functional as F

BLOCKS = int(os.environ.get("PIPEPLAN_GPT_BLOCKS", "4"))
DIM = int(os.environ.get("PIPEPLAN_GPT_DIM", "64"))
HEADS = int(os.environ.get("PIPEPLAN_GPT_HEADS", "4"))
VOCAB = int(os.environ.get("PIPEPLAN_GPT_VOCAB", "2048"))
SEQ = int(os.environ.get("PIPEPLAN_GPT_SEQ", "32"))
TIED = os.environ.get("PIPEPLAN_GPT_TIED", "0") == "1"


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        assert dim % heads == 0, "PIPEPLAN_GPT_DIM must be a multiple of PIPEPLAN_GPT_HEADS"
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)  # (B, T, C_local): this rank's heads
        h = q.shape[-1] // self.head_dim  # heads of the local shard (all of them without TP)
        q = q.view(B, T, h, self.head_dim).transpose(1, 2)  # (B, h, T, D)
        k = k.view(B, T, h, self.head_dim).transpose(1, 2)
        v = v.view(B, T, h, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, D)
        return self.proj(y.transpose(1, 2).reshape(B, T, h * self.head_dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, C)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, DIM)
        self.pos_emb = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([Block(DIM, HEADS) for _ in range(BLOCKS)])
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if TIED:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:  # (B, T) int64 -> (B, T, VOCAB)
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def tp_plan(model: nn.Module) -> dict[str, str]:
    """Megatron's layout: q/k/v and the MLP's first linear split by output column, the attention
    and MLP output projections by input row; the embedding and the head over the vocabulary
    (the head's logits are gathered, so the loss sees them whole)."""
    return {
        "tok_emb": "embedding",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.0": "colwise",
        "blocks.*.mlp.2": "rowwise",
        "head": "colwise_rep",
    }


def make_batch(batch_size: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return (tokens[:, :-1],), tokens[:, 1:]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))
