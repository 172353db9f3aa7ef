"""Mixtral-style MoE LM: the Llama backbone with a top-k mixture of SwiGLU experts as FFN.

Routing is GShard/Switch capacity-based dispatch, written with dense one-hot tensors so every
shape is static (the planner traces on fake tensors; ``nonzero``/boolean indexing would make
shapes data-dependent). Each sequence is a GShard *group*: capacity, the cumsum that assigns
slots and the dispatch/combine tensors ``[batch, seq, experts, capacity]`` are per sequence, so
the batch dim shards with no communication inside the router (a cumsum over all tokens of the
global batch would need a cross-rank prefix sum under data parallel).

Experts are stacked weights ``w1, w3: [E, dim, ffn]`` and ``w2: [E, ffn, dim]`` applied with
``bmm``, so expert parallelism is ``Shard(0)`` on all three. Names:
``layers.{i}.moe.router.weight``, ``layers.{i}.moe.w1/w2/w3``; the rest is as in
:mod:`.llama3`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .llama3 import Attention, LlamaConfig, RMSNorm, Transformer


@dataclass(frozen=True, slots=True)
class MoEConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2
    capacity_factor: float = 1.25
    # Switch Transformer's coefficient; the auxiliary loss is averaged over layers.
    aux_loss_coef: float = 0.01


MOE_CONFIGS: dict[str, MoEConfig] = {
    "moe-tiny": MoEConfig(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=64,
        rope_theta=1e6,
    ),
    "mixtral-8x7b": MoEConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
        rope_theta=1e6,
    ),
}


def expert_capacity(seq: int, n_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per sequence: ``ceil(seq * top_k / n_experts * capacity_factor)``."""
    return min(seq, math.ceil(seq * top_k / n_experts * capacity_factor))


def route(
    logits: torch.Tensor, top_k: int, capacity: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dispatch and combine tensors ``[b, s, E, C]`` and the load-balancing loss from router logits.

    ``dispatch[b, s, e, c]`` is 1 when token s of sequence b sits in slot c of expert e;
    ``combine`` holds its gate weight there. Tokens past an expert's capacity are dropped (their
    row is zero), so combine weights sum to at most 1 per token.
    """
    b, s, n_exp = logits.shape
    probs = logits.float().softmax(-1)
    top_w, top_i = probs.topk(top_k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)  # Mixtral renormalises over the chosen experts
    chosen = top_i.unsqueeze(-1) == torch.arange(n_exp, device=logits.device)  # [b, s, k, E]
    # GShard priority: every token's first choice is seated before any second choice, so the
    # cumsum runs over (k, s) order.
    order = chosen.transpose(1, 2).reshape(b, top_k * s, n_exp).long()
    slot = ((order.cumsum(1) - 1) * order).sum(-1).view(b, top_k, s).transpose(1, 2)  # [b, s, k]
    # A slot >= capacity matches no column, which is exactly a dropped token.
    in_slot = slot.unsqueeze(-1) == torch.arange(capacity, device=logits.device)  # [b, s, k, C]
    chosen_f, in_slot_f = chosen.to(probs.dtype), in_slot.to(probs.dtype)
    dispatch = torch.einsum("bske,bskc->bsec", chosen_f, in_slot_f)
    combine = torch.einsum("bske,bskc->bsec", chosen_f * top_w.unsqueeze(-1), in_slot_f)
    # Switch/Mixtral balance loss: E * sum_e (fraction routed to e) * (mean router prob of e);
    # 1.0 when perfectly balanced.
    frac = chosen_f.sum(2).mean((0, 1)) / top_k
    aux = n_exp * (frac * probs.mean((0, 1))).sum()
    return dispatch, combine, aux


class MoEFeedForward(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor = (
            cfg.n_experts, cfg.top_k, cfg.capacity_factor
        )
        self.router = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w3 = nn.Parameter(torch.empty(cfg.n_experts, cfg.dim, cfg.ffn_dim))
        self.w2 = nn.Parameter(torch.empty(cfg.n_experts, cfg.ffn_dim, cfg.dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, d = x.shape
        cap = expert_capacity(s, self.n_experts, self.top_k, self.capacity_factor)
        dispatch, combine, aux = route(self.router(x), self.top_k, cap)
        xin = torch.einsum("bsec,bsd->ebcd", dispatch.to(x.dtype), x)
        xin = xin.reshape(self.n_experts, b * cap, d)
        h = F.silu(torch.bmm(xin, self.w1)) * torch.bmm(xin, self.w3)
        out = torch.bmm(h, self.w2).view(self.n_experts, b, cap, d)
        return torch.einsum("bsec,ebcd->bsd", combine.to(x.dtype), out), aux


class MoEBlock(nn.Module):
    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.moe = MoEFeedForward(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        y, aux = self.moe(self.ffn_norm(x))
        return x + y, aux


class MoETransformer(Transformer):
    """``forward(tokens, targets=None)``: LM loss + ``aux_loss_coef`` * balance loss, or logits.

    The balance loss is averaged over layers.
    """

    block_cls = MoEBlock
    pipeline_family = "moe"  # blocks return a balance loss beside the hidden state
    config: MoEConfig

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        x = self.tok_embeddings(tokens)
        aux_total = x.new_zeros((), dtype=torch.float32)
        for layer in self.layers:
            x, aux = layer(x, cos, sin)
            aux_total = aux_total + aux
        out = self.lm_loss(x, targets)
        if targets is None:
            return out
        return out + self.config.aux_loss_coef * aux_total / len(self.layers)
