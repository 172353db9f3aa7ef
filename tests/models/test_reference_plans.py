"""Reference plans: complete, valid on any mesh, Megatron-shaped where TP applies, exact."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

from autopar.ir.placements import R, S, Shard, evenly_divides
from autopar.models import REFERENCE_PLANS, applicable_plans, get_preset
from autopar.models.llama3 import apply_rope, repeat_kv
from autopar.models.reference_plans import ReferencePlan, dp_tp_2d, fsdp_tp_2d, megatron_tp

MESHES = [
    ((8,), ("tp",)),
    ((4,), ("dp",)),
    ((3,), ("tp",)),  # divides almost nothing
    ((16,), ("tp",)),  # more ranks than Llama's 8 kv heads
    ((2, 4), ("dp", "tp")),
    ((2, 2, 2), ("pp", "dp", "tp")),
    ((4, 2), ("dp", "cp")),
]
MODELS = ["gpt2-tiny", "gpt2-xl", "llama3-tiny", "llama3-8b", "llama3-1b", "moe-tiny",
          "mixtral-8x7b", "mlp-tiny"]


@functools.cache
def meta_model(name: str) -> torch.nn.Module:
    return get_preset(name).build("meta")


def plan_for(fn_name: str, name: str, mesh_shape, axes, **kw) -> ReferencePlan | None:
    fn = REFERENCE_PLANS[fn_name]
    return fn(meta_model(name), mesh_shape, axes, get_preset(name).family, **kw)


def tp_placement(plan: ReferencePlan, axes, name: str):
    return plan.params[name][axes.index("tp") if "tp" in axes else 0]


@pytest.mark.parametrize("fn_name", list(REFERENCE_PLANS))
@pytest.mark.parametrize("mesh_shape,axes", MESHES)
@pytest.mark.parametrize("name", MODELS)
def test_every_plan_is_complete_and_valid(fn_name: str, name: str, mesh_shape, axes) -> None:
    plan = plan_for(fn_name, name, mesh_shape, axes)
    if plan is None:
        return
    model = meta_model(name)
    assert plan.name == fn_name
    assert set(plan.params) == {n for n, _ in model.named_parameters()}
    for pname, p in model.named_parameters():
        spec = plan.params[pname]
        assert len(spec) == len(mesh_shape), pname
        assert evenly_divides(tuple(p.shape), spec, mesh_shape), (pname, spec, tuple(p.shape))
    assert set(plan.inputs) == {0, 1}
    assert all(len(s) == len(mesh_shape) for s in plan.inputs.values())


@pytest.mark.parametrize("mesh_shape,axes", [((4,), ("tp",)), ((2, 4), ("dp", "tp"))])
def test_megatron_column_then_row(mesh_shape, axes) -> None:
    for fn in ("megatron_tp", "dp_tp_2d"):
        plan = plan_for(fn, "gpt2-tiny", mesh_shape, axes)
        if plan is None:
            assert fn == "dp_tp_2d" and len(axes) == 1
            continue
        tp = functools.partial(tp_placement, plan, axes)
        assert tp("blocks.0.attn.qkv.weight") == S(0) and tp("blocks.0.attn.qkv.bias") == S(0)
        assert tp("blocks.0.attn.proj.weight") == S(1) and tp("blocks.0.attn.proj.bias") == R
        assert tp("blocks.1.mlp.fc.weight") == S(0) and tp("blocks.1.mlp.proj.weight") == S(1)
        assert tp("wte.weight") == S(0) and tp("wpe.weight") == R and tp("ln_f.weight") == R
    plan = plan_for("megatron_tp", "llama3-8b", (8,), ("tp",))
    tp = functools.partial(tp_placement, plan, ("tp",))
    for w in ("wq", "wk", "wv"):
        assert tp(f"layers.3.attention.{w}.weight") == S(0)
    assert tp("layers.3.attention.wo.weight") == S(1)
    assert tp("layers.3.feed_forward.w1.weight") == S(0) == tp("layers.3.feed_forward.w3.weight")
    assert tp("layers.3.feed_forward.w2.weight") == S(1)
    assert tp("tok_embeddings.weight") == S(0) == tp("output.weight")
    assert tp("layers.3.attention_norm.weight") == R
    assert plan.inputs[0] == (R,)
    moe = plan_for("megatron_tp", "mixtral-8x7b", (8,), ("tp",))
    assert moe.params["layers.0.moe.w1"] == (S(0),) == moe.params["layers.0.moe.w2"]
    assert moe.params["layers.0.moe.router.weight"] == (R,)
    mlp = plan_for("megatron_tp", "mlp-tiny", (2,), ("tp",))
    assert [mlp.params[f"layers.{i}.weight"] for i in range(4)] == [(S(0),), (S(1),)] * 2


def test_tp_falls_back_per_layer_when_heads_or_experts_do_not_split() -> None:
    xl = plan_for("megatron_tp", "gpt2-xl", (8,), ("tp",))  # 25 heads
    assert xl.params["blocks.0.attn.qkv.weight"] == (R,) == xl.params["blocks.0.attn.proj.weight"]
    assert xl.params["blocks.0.mlp.fc.weight"] == (S(0),)
    llama = plan_for("megatron_tp", "llama3-8b", (16,), ("tp",))  # 8 kv heads < 16 ranks
    assert llama.params["layers.0.attention.wq.weight"] == (S(0),)
    assert llama.params["layers.0.attention.wk.weight"] == (R,)
    mixtral = plan_for("megatron_tp", "mixtral-8x7b", (16,), ("tp",))  # 8 experts < 16 ranks
    assert mixtral.params["layers.0.moe.w1"] == (S(2),)
    assert mixtral.params["layers.0.moe.w2"] == (S(1),)


def test_not_applicable_layouts_return_none() -> None:
    assert plan_for("megatron_tp", "gpt2-tiny", (2, 4), ("dp", "cp")) is None
    assert plan_for("dp_tp_2d", "gpt2-tiny", (8,), ("tp",)) is None
    assert plan_for("dp_tp_2d", "gpt2-tiny", (2, 4), ("dp", "x")) is None
    assert fsdp_tp_2d(meta_model("gpt2-tiny"), (8,), ("tp",), "gpt2") is None


def test_applicable_plans_drops_the_ones_that_do_not_apply() -> None:
    model = meta_model("llama3-tiny")
    assert set(applicable_plans(model, (8,), ("tp",), "llama3")) == {
        "data_parallel", "fsdp", "megatron_tp"}
    assert set(applicable_plans(model, (2, 4), ("dp", "tp"), "llama3")) == set(REFERENCE_PLANS)


def test_data_parallel_and_fsdp_shard_the_batch_over_every_axis() -> None:
    dp = plan_for("data_parallel", "llama3-tiny", (2, 4), ("dp", "tp"))
    assert dp.inputs[0] == (S(0), S(0)) and set(dp.params.values()) == {(R, R)}
    fs = plan_for("fsdp", "llama3-8b", (2, 4), ("dp", "tp"))
    assert fs.inputs[1] == (S(0), S(0))
    assert fs.params["layers.0.attention.wq.weight"] == (S(0), S(0))
    odd = plan_for("fsdp", "gpt2-xl", (2, 3, 7), ("a", "b", "c"))  # 1600 = 2^6 * 5^2
    assert odd.params["ln_f.weight"] == (S(0), R, R)
    assert plan_for("data_parallel", "llama3-tiny", (4,), ("dp",), batch_size=6).inputs[0] == (R,)


def test_dp_tp_2d_splits_batch_on_dp_only_and_fsdp_tp_nests_dim0() -> None:
    plan = plan_for("dp_tp_2d", "llama3-8b", (2, 2, 2), ("pp", "dp", "tp"))
    assert plan.inputs[0] == (S(0), S(0), R)
    assert plan.params["layers.0.attention.wq.weight"] == (R, R, S(0))
    both = fsdp_tp_2d(meta_model("llama3-8b"), (2, 4), ("dp", "tp"), "llama3")
    assert both.params["layers.0.attention.wq.weight"] == (S(0), S(0))
    assert both.params["layers.0.attention.wo.weight"] == (S(0), S(1))
    assert both.params["norm.weight"] == (S(0), R)


def test_bad_arguments_name_the_problem() -> None:
    with pytest.raises(ValueError, match="one name per mesh axis"):
        megatron_tp(meta_model("gpt2-tiny"), (2, 4), ("tp",), "gpt2")
    with pytest.raises(ValueError, match="family"):
        dp_tp_2d(meta_model("gpt2-tiny"), (2, 4), ("dp", "tp"), "bert")


def _local(t: torch.Tensor, placement, rank: int, n: int) -> torch.Tensor:
    return t.chunk(n, placement.dim)[rank] if isinstance(placement, Shard) else t


@torch.no_grad()
@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny"])
def test_megatron_attention_shards_compute_the_full_attention(name: str) -> None:
    """Each rank runs attention on its slice of the weights; row-parallel outputs sum to the full.

    This pins down the qkv layout (whole heads per rank) and the GQA kv-head grouping.
    """
    torch.manual_seed(0)
    preset, tp = get_preset(name), 2
    model = preset.build()
    plan = megatron_tp(model, (tp,), ("tp",), preset.family)
    x = torch.randn(2, 10, model.config.d_model if name == "gpt2-tiny" else model.config.dim)
    b, s, _ = x.shape
    if name == "gpt2-tiny":
        attn, pre = model.blocks[0].attn, "blocks.0.attn."
        full = attn(x)
        total = attn.proj.bias.clone()
        for r in range(tp):
            w = {k: _local(getattr(attn, k.split(".")[0]).get_parameter(k.split(".")[1]),
                           plan.params[pre + k][0], r, tp)
                 for k in ("qkv.weight", "qkv.bias", "proj.weight")}
            qkv = F.linear(x, w["qkv.weight"], w["qkv.bias"]).view(b, s, -1, 3 * attn.head_dim)
            q, k, v = (t.transpose(1, 2) for t in qkv.split(attn.head_dim, -1))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
            total = total + F.linear(y, w["proj.weight"])
    else:
        attn, pre = model.layers[0].attention, "layers.0.attention."
        cos, sin = model.rope(s)
        full = attn(x, cos, sin)
        total = torch.zeros_like(full)
        hd = attn.head_dim
        for r in range(tp):
            w = {k: _local(getattr(attn, k).weight, plan.params[f"{pre}{k}.weight"][0], r, tp)
                 for k in ("wq", "wk", "wv", "wo")}
            q = apply_rope(F.linear(x, w["wq"]).view(b, s, -1, hd), cos, sin).transpose(1, 2)
            k = apply_rope(F.linear(x, w["wk"]).view(b, s, -1, hd), cos, sin).transpose(1, 2)
            v = F.linear(x, w["wv"]).view(b, s, -1, hd).transpose(1, 2)
            rep = q.shape[1] // k.shape[1]
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            total = total + F.linear(y.transpose(1, 2).flatten(2), w["wo"])
    torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def test_megatron_on_hugging_face_layers() -> None:
    """Family "hf": GPT-2's Conv1D layers (weights [in, out]) column then row, Llama's GQA and
    SwiGLU as Megatron places them, an untied LM head vocab-parallel, Mixtral's fused experts
    whole per rank; a layer whose sizes do not split is replicated as a unit."""
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=4, n_inner=30))
    p = megatron_tp(gpt2, (2,), ("tp",), "hf").params
    h = "transformer.h.0."
    assert p[h + "attn.c_attn.weight"] == (S(1),) and p[h + "attn.c_attn.bias"] == (S(0),)
    assert p[h + "attn.c_proj.weight"] == (S(0),) and p[h + "attn.c_proj.bias"] == (R,)
    assert p["transformer.wte.weight"] == (S(0),)
    p4 = megatron_tp(gpt2, (4,), ("tp",), "hf").params  # FFN width 30: MLP stays whole
    assert p4[h + "mlp.c_fc.weight"] == p4[h + "mlp.c_proj.weight"] == (R,)
    assert p4[h + "attn.c_attn.weight"] == (S(1),)

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    p = dp_tp_2d(llama, (2, 4), ("dp", "tp"), "hf").params
    a, m = "model.layers.0.self_attn.", "model.layers.0.mlp."
    assert p[a + "q_proj.weight"] == (R, S(0)) and p[a + "o_proj.weight"] == (R, S(1))
    assert p[a + "k_proj.weight"] == p[a + "v_proj.weight"] == (R, R)  # 2 kv heads, tp=4
    assert p[m + "gate_proj.weight"] == p[m + "up_proj.weight"] == (R, S(0))
    assert p[m + "down_proj.weight"] == (R, S(1))
    assert p["lm_head.weight"] == p["model.embed_tokens.weight"] == (R, S(0))
    assert p["model.norm.weight"] == (R, R)

    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **small, num_local_experts=4, num_experts_per_tok=2))
    p = fsdp_tp_2d(mixtral, (2, 2), ("dp", "tp"), "hf").params
    e = "model.layers.0.mlp.experts."
    assert p[e + "gate_up_proj"] == p[e + "down_proj"] == (S(0), S(0))  # fsdp nests outside tp
    assert p["model.layers.0.mlp.gate.weight"] == (S(0), R)
