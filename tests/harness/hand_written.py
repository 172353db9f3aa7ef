"""Models written by hand as people write them, not as autopar's own: shared by the tests of
capture's repeated blocks and of pipelines of such models."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB = 64


class DictDecoder(nn.Module):
    """A decoder written by hand: each block a ModuleDict of its parts."""

    def __init__(self, n_layers: int = 4, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, d)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "ln1": nn.LayerNorm(d), "qkv": nn.Linear(d, 3 * d), "proj": nn.Linear(d, d),
            "ln2": nn.LayerNorm(d), "up": nn.Linear(d, 4 * d), "down": nn.Linear(4 * d, d),
        }) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        b, s, d = x.shape
        for blk in self.layers:
            qkv = blk["qkv"](blk["ln1"](x)).view(b, s, 3, self.heads, d // self.heads)
            q, k, v = (t.transpose(1, 2) for t in qkv.unbind(2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk["proj"](a.transpose(1, 2).reshape(b, s, d))
            x = x + blk["down"](F.gelu(blk["up"](blk["ln2"](x))))
        return self.head(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
