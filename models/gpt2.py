"""GPT-2 family: pre-LN decoder with learned positions, GELU MLP and tied embeddings.

Parameter names follow Megatron's split of a block so reference plans can be written against
them: ``blocks.{i}.attn.qkv`` (fused, column-parallel), ``blocks.{i}.attn.proj`` (row-parallel),
``blocks.{i}.mlp.fc`` / ``blocks.{i}.mlp.proj``, ``blocks.{i}.ln1`` / ``ln2``, ``ln_f``, ``wte``,
``wpe``. The LM head is ``wte.weight`` itself, so it appears once in ``named_parameters()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.ir.blocks import PipelineBlocks


@dataclass(frozen=True, slots=True)
class GPT2Config:
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    n_positions: int = 1024
    dropout: float = 0.0
    bias: bool = True
    layer_norm_eps: float = 1e-5
    # True: one fused attention kernel (torch's SDPA). False: attention as Megatron-LM ran it
    # before fused kernels (2021-22): the scores materialized, scaled, masked, softmaxed and
    # dropped out as their own kernels between two batched GEMMs
    fused_attention: bool = True

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not a multiple of n_head={self.n_head}; "
                "pick a d_model that splits into whole heads"
            )

    @property
    def seq_len(self) -> int:
        return self.n_positions

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


# The vocabulary is GPT-2's 50257 padded to 50304 (a multiple of 128, as Megatron and nanoGPT do)
# so vocab-parallel embeddings split evenly over tensor-parallel sizes up to 128; the extra rows
# are never indexed and change parameter counts by < 0.05%.
GPT2_CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(vocab_size=256, n_layer=2, n_head=4, d_model=64, n_positions=64),
    "gpt2-small": GPT2Config(n_layer=12, n_head=12, d_model=768),
    "gpt2-medium": GPT2Config(n_layer=24, n_head=16, d_model=1024),
    "gpt2-large": GPT2Config(n_layer=36, n_head=20, d_model=1280),
    "gpt2-xl": GPT2Config(n_layer=48, n_head=25, d_model=1600),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.fused = cfg.fused_attention
        # Output rows are laid out head-major, [head][q|k|v][head_dim] (Megatron's layout), so
        # sharding qkv.weight on dim 0 by whole heads hands each rank the q, k and v of its heads.
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        qkv = self.qkv(x).view(b, s, self.n_head, 3 * self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.split(self.head_dim, dim=-1))
        p = self.dropout if self.training else 0.0
        if self.fused:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            # the scale folded into the first GEMM's operand (Megatron: baddbmm's alpha)
            scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            y = F.dropout(probs, p, self.training) @ v if p > 0 else probs @ v
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.dropout = cfg.dropout

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        # p == 0 skips the call entirely so traced graphs carry no no-op dropout nodes.
        return F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._drop(self.attn(self.ln1(x)))
        return x + self._drop(self.mlp(self.ln2(x)))


class GPT2(nn.Module):
    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.n_positions, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps, bias=config.bias)
        if not self.wte.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 initialisation, in place; call after ``to_empty()`` to materialise a meta model."""
        std = 0.02
        # Residual-branch outputs shrink with depth so the residual stream's variance stays ~1.
        resid_std = std / math.sqrt(2 * self.config.n_layer)
        nn.init.normal_(self.wte.weight, std=std)
        nn.init.normal_(self.wpe.weight, std=std / 2)
        for block in self.blocks:
            for lin, s in (
                (block.attn.qkv, std),
                (block.attn.proj, resid_std),
                (block.mlp.fc, std),
                (block.mlp.proj, resid_std),
            ):
                nn.init.normal_(lin.weight, std=s)
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)
        for ln in [b.ln1 for b in self.blocks] + [b.ln2 for b in self.blocks] + [self.ln_f]:
            ln.reset_parameters()

    def pipeline_blocks(self) -> PipelineBlocks:
        """Where a pipeline finds the pieces (:mod:`autopar.ir.blocks`): the embedding, tied
        as the head, with learned positions; blocks of the hidden state alone."""
        return PipelineBlocks("gpt2", "blocks", "wte", "ln_f", head=None, positions="wpe")

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean cross-entropy loss when ``targets`` is given, else logits (batch, seq, vocab)."""
        seq = tokens.shape[1]
        if seq > self.config.n_positions:
            raise ValueError(
                f"sequence length {seq} exceeds n_positions={self.config.n_positions}; "
                "build from a config with a larger n_positions"
            )
        x = self.wte(tokens) + self.wpe.weight[:seq]
        if self.config.dropout > 0:
            x = F.dropout(x, self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
