"""A tiny GPT and the data it trains on, made here (no downloads)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "SyntheticTokens", "TinyGPT", "warmup_cosine"]


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    seq_len: int = 16
    width: int = 32
    layers: int = 2
    heads: int = 2


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width, bias=False)
        self.proj = nn.Linear(cfg.width, cfg.width, bias=False)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.up = nn.Linear(cfg.width, 4 * cfg.width, bias=False)
        self.down = nn.Linear(4 * cfg.width, cfg.width, bias=False)
        self.drop = nn.Dropout(0.1)  # consumes the torch RNG: the drill checks it is restored

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Parameter(torch.zeros(cfg.seq_len, cfg.width))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def loss(self, batch: dict) -> torch.Tensor:
        tokens = batch["tokens"]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class SyntheticTokens:
    """A fixed corpus of token sequences from a seeded first-order Markov chain.

    Made from ``seed`` with torch's CPU generator, so every process builds the
    same corpus; it has structure for the model to learn.
    """

    def __init__(self, num_samples: int = 512, cfg: GPTConfig = GPTConfig(), seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        transitions = torch.softmax(torch.randn(cfg.vocab, cfg.vocab, generator=g) * 3, dim=-1)
        tokens = torch.empty(num_samples, cfg.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(cfg.vocab, (num_samples,), generator=g)
        for t in range(1, cfg.seq_len + 1):
            tokens[:, t] = torch.multinomial(transitions[tokens[:, t - 1]], 1, generator=g).squeeze(1)
        self.tokens = tokens

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> dict:
        return {"tokens": self.tokens[index]}


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """LR multiplier: linear warmup over ``warmup`` updates, cosine to ``floor`` at ``total``."""
    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        progress = min(1.0, (update - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor
