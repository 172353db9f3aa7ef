"""Model zoo: tiny presets train on CPU, big presets build on meta with the published sizes."""

from __future__ import annotations

import math
import time

import pytest
import torch

from autopar.models import PRESETS, UnknownPresetError, get_preset
from autopar.models.llama3 import apply_rope, repeat_kv, rope_tables
from autopar.models.moe import MoEConfig, MoETransformer, expert_capacity, route

TINY = ["gpt2-tiny", "llama3-tiny", "moe-tiny", "mlp-tiny"]

# Published parameter counts (embeddings included, tied ones once).
PUBLISHED = {
    "gpt2-small": 124e6,
    "gpt2-medium": 355e6,
    "gpt2-large": 774e6,
    "gpt2-xl": 1.558e9,
    "llama3-1b": 1.24e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    "mixtral-8x7b": 46.7e9,
}


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", TINY)
def test_tiny_preset_trains_on_cpu(name: str) -> None:
    torch.manual_seed(0)
    preset = get_preset(name)
    model = preset.build()
    inputs = preset.example_inputs(batch=2, seq=16, device="cpu")
    loss = model(*inputs)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    if preset.family != "mlp":
        # Small init gives near-uniform predictions: loss ~ ln(vocab) (+ aux ~0.01 for MoE).
        assert abs(loss.item() - math.log(preset.config.vocab_size)) < 0.3


@pytest.mark.parametrize("name", ["gpt2-tiny", "llama3-tiny", "moe-tiny"])
def test_lm_returns_logits_without_targets(name: str) -> None:
    preset = get_preset(name)
    tokens, _ = preset.example_inputs(2, 8, device="cpu")
    logits = preset.build()(tokens)
    assert logits.shape == (2, 8, preset.config.vocab_size)


def test_mlp_returns_output_without_targets() -> None:
    preset = get_preset("mlp-tiny")
    x, y = preset.example_inputs(3, seq=999, device="cpu")
    assert x.shape == (3, 16) and y.shape == (3, 8) and x.dtype == torch.float32
    assert preset.build()(x).shape == y.shape


def test_example_inputs_are_meta_long_tensors() -> None:
    tokens, targets = get_preset("llama3-8b").example_inputs(4, 128)
    assert tokens.is_meta and tokens.shape == (4, 128) and tokens.dtype == torch.long
    assert targets.shape == tokens.shape and targets.dtype == torch.long


def test_sequence_longer_than_positions_is_a_clear_error() -> None:
    preset = get_preset("llama3-tiny")
    with pytest.raises(ValueError, match="max_seq_len"):
        preset.example_inputs(1, preset.config.max_seq_len + 1)
    longer = preset.replace(max_seq_len=128)
    assert longer.example_inputs(1, 128)[0].shape == (1, 128)
    model = preset.build()
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_build_in_bf16_keeps_rope_tables_fp32() -> None:
    model = get_preset("llama3-tiny").build(dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.rope_cos.dtype == torch.float32
    loss = model(torch.randint(0, 512, (1, 8)), torch.randint(0, 512, (1, 8)))
    assert torch.isfinite(loss)


@pytest.mark.parametrize("name", list(PRESETS))
def test_meta_build_is_fast_and_allocates_nothing(name: str) -> None:
    start = time.perf_counter()
    model = PRESETS[name].build(device="meta")
    assert time.perf_counter() - start < 5.0
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())
    if name in PUBLISHED:
        assert n_params(model) == pytest.approx(PUBLISHED[name], rel=0.03)


def test_unknown_preset_suggests_the_closest_name() -> None:
    with pytest.raises(UnknownPresetError, match="llama3-8b") as err:
        get_preset("llama-8b")
    assert isinstance(err.value, KeyError) and isinstance(err.value, ValueError)
    assert "gpt2-small" in str(err.value)  # lists the known names


def test_parameter_names_are_megatron_friendly() -> None:
    gpt2 = dict(get_preset("gpt2-tiny").build("meta").named_parameters())
    for n in ["wte.weight", "wpe.weight", "ln_f.weight", "blocks.0.attn.qkv.weight",
              "blocks.0.attn.proj.bias", "blocks.1.mlp.fc.weight", "blocks.1.mlp.proj.weight",
              "blocks.0.ln1.weight", "blocks.0.ln2.bias"]:
        assert n in gpt2, n
    assert "lm_head.weight" not in gpt2  # tied to wte
    llama = dict(get_preset("llama3-8b").build("meta").named_parameters())
    for n in ["tok_embeddings.weight", "norm.weight", "output.weight",
              "layers.31.attention.wq.weight", "layers.0.attention.wk.weight",
              "layers.0.feed_forward.w1.weight", "layers.0.feed_forward.w2.weight",
              "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight"]:
        assert n in llama, n
    assert llama["layers.0.attention.wk.weight"].shape == (8 * 128, 4096)
    tied = dict(get_preset("llama3-1b").build("meta").named_parameters())
    assert "output.weight" not in tied
    moe = dict(get_preset("mixtral-8x7b").build("meta").named_parameters())
    assert moe["layers.0.moe.w1"].shape == (8, 4096, 14336)
    assert moe["layers.0.moe.w2"].shape == (8, 14336, 4096)
    assert moe["layers.0.moe.router.weight"].shape == (8, 4096)


def test_rope_is_a_rotation_that_encodes_relative_position() -> None:
    cos, sin = rope_tables(head_dim=16, max_seq_len=32, theta=10000.0)
    assert cos.shape == sin.shape == (32, 16)
    # The same q and k vectors at every position, so only the rotation differs.
    q = torch.randn(1, 1, 1, 16).expand(1, 32, 1, 16)
    k = torch.randn(1, 1, 1, 16).expand(1, 32, 1, 16)
    rq, rk = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[0, :, None, 0] * rk[0, None, :, 0]).sum(-1)  # [32, 32], depends on m - n only
    torch.testing.assert_close(dots[5, 2], dots[20, 17])
    torch.testing.assert_close(dots[3, 9], dots[10, 16])


def test_rope_scaling_changes_only_low_frequencies() -> None:
    plain = rope_tables(128, 4, 500000.0)[1]
    scaled = rope_tables(128, 4, 500000.0, scaling=8.0)[1]
    torch.testing.assert_close(plain[:, :8], scaled[:, :8])  # short wavelengths kept
    assert not torch.allclose(plain[:, 56:64], scaled[:, 56:64])


def test_gqa_repeats_each_kv_head_for_its_query_group() -> None:
    kv = torch.randn(2, 2, 5, 8)
    out = repeat_kv(kv, 3)
    assert out.shape == (2, 6, 5, 8)
    for h in range(6):
        torch.testing.assert_close(out[:, h], kv[:, h // 3])


def test_moe_dispatch_respects_capacity_and_combine_weights() -> None:
    torch.manual_seed(0)
    b, s, e, k = 3, 40, 4, 2
    cap = expert_capacity(s, e, k, capacity_factor=1.0)
    logits = torch.randn(b, s, e) + torch.tensor([3.0, 0, 0, 0])  # crowd expert 0 to force drops
    dispatch, combine, aux = route(logits, k, cap)
    assert dispatch.shape == combine.shape == (b, s, e, cap)
    assert (dispatch.sum(1) <= 1).all()  # a slot holds at most one token
    assert (dispatch.sum((2, 3)) <= k).all()  # a token takes at most top_k slots
    assert (dispatch.sum((1, 3)) <= cap).all()  # an expert takes at most `cap` tokens
    assert (combine.sum((2, 3)) <= 1 + 1e-6).all()
    assert (combine.sum((2, 3)) < 1 - 1e-3).any()  # some tokens were dropped
    assert ((combine > 0) <= (dispatch > 0)).all()
    assert aux > 1.0  # imbalance costs more than the balanced optimum of 1


def test_moe_without_drops_matches_a_per_token_loop() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(vocab_size=64, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=8,
                    n_experts=4, max_seq_len=16, capacity_factor=4.0)
    moe = MoETransformer(cfg).layers[0].moe
    x = torch.randn(2, 8, 16)
    y, _ = moe(x)
    probs = moe.router(x).softmax(-1)
    w, idx = probs.topk(2, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for bi in range(2):
        for si in range(8):
            for j in range(2):
                ex, t = idx[bi, si, j], x[bi, si]
                h = torch.nn.functional.silu(t @ moe.w1[ex]) * (t @ moe.w3[ex])
                ref[bi, si] += w[bi, si, j] * (h @ moe.w2[ex])
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-5)


# --- the same numbers as Hugging Face's implementations, weights copied across ---------------


def _hf():
    return pytest.importorskip("transformers")


def _load(hf: torch.nn.Module, sd: dict[str, torch.Tensor]) -> None:
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected and not missing, (missing, unexpected)


@torch.no_grad()
def test_gpt2_matches_hugging_face() -> None:
    tf = _hf()
    torch.manual_seed(0)
    ours = get_preset("gpt2-tiny").build()
    c = ours.config
    hf = tf.GPT2LMHeadModel(tf.GPT2Config(
        vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.d_model, n_layer=c.n_layer,
        n_head=c.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )).eval()
    h, hd, d = c.n_head, c.head_dim, c.d_model
    sd = {"transformer.wte.weight": ours.wte.weight, "transformer.wpe.weight": ours.wpe.weight,
          "transformer.ln_f.weight": ours.ln_f.weight, "transformer.ln_f.bias": ours.ln_f.bias,
          "lm_head.weight": ours.wte.weight}
    for i, blk in enumerate(ours.blocks):
        p = f"transformer.h.{i}."
        # Ours is head-major [head][q|k|v][hd]; HF's Conv1D is [in, q|k|v] with heads inside.
        qkv_w = blk.attn.qkv.weight.view(h, 3, hd, d).transpose(0, 1).reshape(3 * d, d)
        sd |= {p + "attn.c_attn.weight": qkv_w.T,
               p + "attn.c_attn.bias": blk.attn.qkv.bias.view(h, 3, hd).transpose(0, 1).flatten(),
               p + "attn.c_proj.weight": blk.attn.proj.weight.T,
               p + "attn.c_proj.bias": blk.attn.proj.bias,
               p + "mlp.c_fc.weight": blk.mlp.fc.weight.T, p + "mlp.c_fc.bias": blk.mlp.fc.bias,
               p + "mlp.c_proj.weight": blk.mlp.proj.weight.T,
               p + "mlp.c_proj.bias": blk.mlp.proj.bias}
        for ln in ("ln1", "ln2"):
            hf_ln = p + ("ln_1." if ln == "ln1" else "ln_2.")
            sd |= {hf_ln + "weight": getattr(blk, ln).weight, hf_ln + "bias": getattr(blk, ln).bias}
    _load(hf, sd)
    tokens = torch.randint(0, c.vocab_size, (2, 12))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


def _llama_sd(ours, moe: bool = False) -> dict[str, torch.Tensor]:
    sd = {"model.embed_tokens.weight": ours.tok_embeddings.weight,
          "model.norm.weight": ours.norm.weight, "lm_head.weight": ours.head_weight()}
    for i, layer in enumerate(ours.layers):
        p, a = f"model.layers.{i}.", layer.attention
        sd |= {p + "self_attn.q_proj.weight": a.wq.weight,
               p + "self_attn.k_proj.weight": a.wk.weight,
               p + "self_attn.v_proj.weight": a.wv.weight,
               p + "self_attn.o_proj.weight": a.wo.weight,
               p + "input_layernorm.weight": layer.attention_norm.weight,
               p + "post_attention_layernorm.weight": layer.ffn_norm.weight}
        if moe:
            m = layer.moe
            sd |= {p + "mlp.gate.weight": m.router.weight,
                   p + "mlp.experts.gate_up_proj": torch.cat([m.w1, m.w3], 2).transpose(1, 2),
                   p + "mlp.experts.down_proj": m.w2.transpose(1, 2)}
        else:
            f = layer.feed_forward
            sd |= {p + "mlp.gate_proj.weight": f.w1.weight, p + "mlp.up_proj.weight": f.w3.weight,
                   p + "mlp.down_proj.weight": f.w2.weight}
    return sd


def _hf_llama_kwargs(c) -> dict:
    return dict(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
                num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
                num_key_value_heads=c.n_kv_heads, rms_norm_eps=c.norm_eps,
                max_position_embeddings=c.max_seq_len, tie_word_embeddings=False)


@torch.no_grad()
def test_llama_with_rope_scaling_matches_hugging_face() -> None:
    tf = _hf()
    torch.manual_seed(0)
    # head_dim 32 so some RoPE wavelengths exceed 8192 / 4 and the Llama-3.1 scaling acts.
    ours = get_preset("llama3-tiny").replace(dim=128, rope_scaling=8.0, max_seq_len=16384).build()
    c = ours.config
    rope = {"rope_type": "llama3", "rope_theta": c.rope_theta, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    hf = tf.LlamaForCausalLM(tf.LlamaConfig(**_hf_llama_kwargs(c), rope_parameters=rope)).eval()
    _load(hf, _llama_sd(ours))
    # Far positions, where a wrong low-frequency scaling would show.
    pos = torch.arange(0, 16384, 97)[None]
    hf_cos, hf_sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    torch.testing.assert_close(ours.rope_cos[pos[0]], hf_cos[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ours.rope_sin[pos[0]], hf_sin[0], rtol=1e-4, atol=1e-4)
    tokens = torch.randint(0, c.vocab_size, (2, 12))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_moe_matches_hugging_face_mixtral_when_nothing_is_dropped() -> None:
    tf = _hf()
    torch.manual_seed(0)
    ours = get_preset("moe-tiny").replace(capacity_factor=8.0).build()
    c = ours.config
    hf = tf.MixtralForCausalLM(tf.MixtralConfig(
        **_hf_llama_kwargs(c), num_local_experts=c.n_experts, num_experts_per_tok=c.top_k,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
    )).eval()
    _load(hf, _llama_sd(ours, moe=True))
    tokens = torch.randint(0, c.vocab_size, (2, 12))
    torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
