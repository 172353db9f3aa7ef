"""Small Hugging Face causal LMs built from configs (random weights), their keyword inputs, and
a few AdamW steps: shared by the tests that run them through autopar. ``transformers`` is
imported on first use, so a test skips (``pytest.importorskip``) before calling these."""

from __future__ import annotations

from collections.abc import Callable

import torch

from harness.spmd import EPS, LR


def gpt2(dropout: bool = False):
    import transformers

    pdrop = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  **pdrop)  # with dropout: GPT-2's own 0.1 everywhere
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def mixtral():
    import transformers

    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=16,
                                     num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def inputs() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (4, 8))
    return {"input_ids": ids, "labels": ids}


def train_steps(loss_of: Callable[[], torch.Tensor], params, steps: int = 3) -> list:
    """``steps`` AdamW steps on ``loss_of()``; the losses, detached."""
    opt = torch.optim.AdamW(params, lr=LR, eps=EPS)
    losses = []
    for _ in range(steps):
        loss = loss_of()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses
