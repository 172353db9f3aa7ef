"""Llama-3 family: RMSNorm, rotary positions, grouped-query attention and a SwiGLU FFN.

Names follow Meta's reference code (and torchtitan): ``tok_embeddings``,
``layers.{i}.attention.{wq,wk,wv,wo}``, ``layers.{i}.feed_forward.{w1,w2,w3}``,
``layers.{i}.attention_norm`` / ``ffn_norm``, ``norm``, ``output``. With tied embeddings
(Llama-3.2-1B) there is no ``output`` module: the head is ``tok_embeddings.weight``.

RoPE uses the real-valued rotate-half form: complex tensors have no sharding rules worth the
name, and cos/sin buffers are plain ``[max_seq_len, head_dim]`` tensors that build on meta.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.ir.blocks import PipelineBlocks


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int = 128256
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn_dim: int = 14336
    rope_theta: float = 500000.0
    # Llama-3.1 long-context frequency scaling factor (None: plain RoPE, as in Llama-3.0).
    rope_scaling: float | None = None
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}: dim must "
                "split into whole heads and n_heads must be a multiple of n_kv_heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(f"head_dim={self.dim // self.n_heads} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    "llama3-tiny": LlamaConfig(
        vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
    ),
    "llama3-1b": LlamaConfig(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, rope_scaling=32.0,
        tie_embeddings=True,
    ),
    "llama3-8b": LlamaConfig(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, rope_scaling=8.0
    ),
    "llama3-70b": LlamaConfig(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, rope_scaling=8.0
    ),
    "llama3-405b": LlamaConfig(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248, rope_scaling=8.0
    ),
}


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` of shape ``[max_seq_len, head_dim]`` for the rotate-half form."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    if scaling is not None:
        freqs = _llama31_scale(freqs, scaling)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _llama31_scale(
    freqs: torch.Tensor, factor: float, low: float = 1.0, high: float = 4.0, old_ctx: int = 8192
) -> torch.Tensor:
    # Meta's Llama-3.1 rule: keep high frequencies, divide low ones by `factor`, blend between.
    wavelen = 2 * math.pi / freqs
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * freqs / factor + smooth * freqs


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[batch, seq, heads, head_dim]`` by per-position angles, in fp32."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).type_as(x)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``[b, kv, s, hd]`` -> ``[b, kv * n_rep, s, hd]``; q head h reads kv head h // n_rep."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The statistic is taken in fp32 as Llama does; bf16 mean-of-squares loses too much.
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = apply_rope(self.wq(x).view(b, s, self.n_heads, self.head_dim), cos, sin)
        k = apply_rope(self.wk(x).view(b, s, self.n_kv_heads, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, self.n_kv_heads, self.head_dim)
        rep = self.n_heads // self.n_kv_heads
        q = q.transpose(1, 2)
        k, v = repeat_kv(k.transpose(1, 2), rep), repeat_kv(v.transpose(1, 2), rep)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, ffn_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Llama-3 decoder. ``forward(tokens, targets=None)``: mean CE loss, or logits."""

    block_cls: type[nn.Module] = TransformerBlock

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(self.block_cls(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        if not config.tie_embeddings:
            self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        # Not persistent: a pure function of the config, so checkpoints need not carry them.
        shape = (config.max_seq_len, config.head_dim)
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise parameters and RoPE tables in place; call after ``to_empty()``."""
        cfg = self.config
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        std = 0.02
        # Projections that write into the residual stream shrink with depth (GPT-2's rule).
        resid_std = std / math.sqrt(2 * cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(p)
            elif name.endswith(("wo.weight", "w2.weight", ".w2")):
                nn.init.normal_(p, std=resid_std)
            else:
                nn.init.normal_(p, std=std)

    pipeline_family = "llama3"  # how a pipeline calls the blocks (autopar.ir.blocks)

    def pipeline_blocks(self) -> PipelineBlocks:
        """Where a pipeline finds the pieces (:mod:`autopar.ir.blocks`): blocks that read
        the model's rotary tables; the head is the embedding's weight where tied."""
        return PipelineBlocks(self.pipeline_family, "layers", "tok_embeddings", "norm",
                              head=None if self.config.tie_embeddings else "output",
                              rotary=True)

    def head_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.config.tie_embeddings else self.output.weight

    def rope(self, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables for the first ``seq`` positions."""
        if seq > self.config.max_seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds max_seq_len={self.config.max_seq_len}; build from "
                "dataclasses.replace(config, max_seq_len=...) or preset.replace(max_seq_len=...)"
            )
        return self.rope_cos[:seq], self.rope_sin[:seq]

    def lm_loss(self, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        logits = F.linear(self.norm(x), self.head_weight())
        if targets is None:
            return logits
        # fp32 logits for the softmax: bf16 log-sum-exp over 128K classes is too coarse.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def forward(
        self, tokens: torch.Tensor, targets: torch.Tensor | None = None
    ) -> torch.Tensor:
        cos, sin = self.rope(tokens.shape[1])
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_loss(x, targets)
