"""FLOPs of a traced attention op as a fused kernel does them (a trace on the CPU records the
CPU kernel, for which torch has no formula)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autopar.capture.joint import capture


class Attn(torch.nn.Module):
    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.causal = causal
        self.w = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = (x @ self.w).view(2, 32, 4, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=self.causal).sum()


@pytest.mark.parametrize("causal", [False, True])
def test_attention_flops_forward_and_backward(causal):
    pg = capture(Attn(causal), (torch.randn(2, 32, 16),))
    got = {}
    for n in pg.graph.nodes:
        f = n.meta.get("autopar")
        if f is not None and "scaled_dot_product" in f.op:
            got["bwd" if "backward" in f.op else "fwd"] = f.flops
    full = 4 * 2 * 4 * 32 * 32 * 4  # 4 b h s^2 d
    assert got["fwd"] == full / (2 if causal else 1)
    assert got["bwd"] == pytest.approx(2.5 * got["fwd"])
