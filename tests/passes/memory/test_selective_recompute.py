"""Selective recomputation keeps the GEMMs' outputs and recomputes everything else in a layer
(torchtitan's per-op selective checkpointing), the attention core whole (Megatron's): with a
fused attention kernel, recomputing the attention core alone kept the norms' and the MLP's
elementwise results and saved almost nothing."""

from __future__ import annotations

import torch

import autopar
from autopar.capture.joint import capture
from autopar.models import get_preset
from autopar.passes.memory.recompute import (
    KEPT_BY_SELECTIVE,
    apply_recompute,
    draws,
    recompute_nodes,
    selective,
)
from autopar.passes.problem import sharding_problem
from autopar.planning.memory_fit import leanest


def _graph():
    preset = get_preset("llama3-tiny")
    torch.manual_seed(0)
    model = preset.build("cpu")
    return capture(model, preset.example_inputs(4, 64, "cpu"))


def test_selective_keeps_only_gemm_outputs_in_a_layer():
    graph = _graph()
    chosen = recompute_nodes(graph, "selective")
    ops = {n.meta["autopar"].op for n in graph.graph.nodes if n.name in set(chosen)}
    assert "aten.silu.default" in ops  # the MLP's activation, outside the attention
    assert any("attention" in op for op in ops)  # the fused kernel: no S x S tensor kept
    kept_gemms = 0
    rewritten = apply_recompute(graph, chosen)
    for n in rewritten.graph.nodes:
        f = n.meta.get("autopar")
        if (f is None or n.op != "call_function" or f.phase != "fwd" or f.layer is None
                or f.role != "activation" or "param_cast" in f.extra):
            continue
        if not any(u.meta["autopar"].phase == "bwd" for u in n.users if "autopar" in u.meta):
            continue  # freed in the forward, or recomputed
        if isinstance(n.target, torch._ops.OpOverload) and draws(n.target, n.args, n.kwargs):
            continue
        # what a layer keeps for its backward: a GEMM's output outside the attention core
        assert f.op in KEPT_BY_SELECTIVE, (n.name, f.op)
        assert not selective(n.meta.get("custom") or {}, f.op)
        kept_gemms += 1
    assert kept_gemms > 0


def test_selective_saves_more_than_the_attention_core_alone():
    graph = _graph()
    mesh = autopar.Mesh((2,), ("dp",), "h100")

    def lean(names):
        return leanest(sharding_problem.build(apply_recompute(graph, names), mesh))[0]

    core = [n.name for n in graph.graph.nodes
            if n.name in set(recompute_nodes(graph, "full"))
            and selective(n.meta.get("custom") or {}, None)]  # Megatron's attention core
    none, sel = lean([]), lean(recompute_nodes(graph, "selective"))
    full, attention_only = lean(recompute_nodes(graph, "full")), lean(core)
    assert full <= sel < attention_only <= none
