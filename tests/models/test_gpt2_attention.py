"""GPT-2's attention as one fused kernel or unfused (Megatron-LM's before fused kernels):
the same function, and the unfused one traced with its scores materialized."""

from __future__ import annotations

import torch

from autopar.capture.joint import capture
from autopar.models import ModelPreset
from autopar.models.gpt2 import GPT2Config


def test_unfused_attention_computes_what_the_fused_one_does():
    cfg = GPT2Config(vocab_size=64, n_layer=2, n_head=4, d_model=32, n_positions=16)
    fused = ModelPreset("f", "gpt2", cfg)
    unfused = fused.replace(fused_attention=False)
    torch.manual_seed(0)
    a = fused.build("cpu")
    b = unfused.build("cpu")
    b.load_state_dict(a.state_dict())
    tokens, targets = fused.example_inputs(3, 16, "cpu")
    torch.testing.assert_close(a(tokens, targets), b(tokens, targets))


def test_unfused_attention_materializes_the_scores():
    cfg = GPT2Config(vocab_size=64, n_layer=1, n_head=4, d_model=32, n_positions=16,
                     fused_attention=False, dropout=0.1)
    preset = ModelPreset("u", "gpt2", cfg)
    pg = capture(preset.build("meta"), preset.example_inputs(2, 16))
    ops = {n.meta["autopar"].op for n in pg.graph.nodes if "autopar" in n.meta}
    assert not any("scaled_dot_product" in op for op in ops)
    assert "aten._softmax.default" in ops
    scores = [n for n in pg.graph.nodes if "autopar" in n.meta
              and n.meta["autopar"].op == "aten._softmax.default"]
    assert tuple(scores[0].meta["autopar"].out.shape) == (2, 4, 16, 16)
