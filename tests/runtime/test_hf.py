"""Hugging Face causal LMs built from small configs, parallelized unmodified (simulated mesh).

The model is called with keyword inputs (``input_ids=..., labels=...``) and returns an output
object with ``.loss``; autopar traces that as it is.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from harness.hf import gpt2, inputs, llama, mixtral, train_steps
from harness.spmd import (
    EXAMPLES,
    PLANS,
    RNG_SEED,
    SETTINGS,
    _whole,
    assert_same_training,
    check_collectives,
    fake_world,
    mesh_for,
    reconcile,
    reference_plan,
    rel_err,
    run_case,
)
from hypothesis import example, given, settings
from hypothesis import strategies as st

import autopar

transformers = pytest.importorskip("transformers")


def _check(build, mesh_shape) -> None:
    torch.manual_seed(0)
    model = build().train()
    kw = inputs()
    ref = copy.deepcopy(model)
    torch.manual_seed(RNG_SEED)  # both trainings draw dropout masks alike
    want = [loss.item() for loss in train_steps(lambda: ref(**kw).loss, ref.parameters())]
    mesh = mesh_for(mesh_shape)
    with fake_world(mesh.size):
        pm = autopar.parallelize(model, mesh, example_kwargs=kw, time_limit_s=2.0)
        torch.manual_seed(RNG_SEED)
        got = [reconcile(loss).item() for loss in train_steps(lambda: pm(**kw), pm.parameters())]
        params = {n: _whole(p) for n, p in pm.named_parameters()}
    assert got == pytest.approx(want, rel=1e-5)
    for n, p in ref.named_parameters():
        assert rel_err(params[n], p.detach()) < 1e-5, n


def test_hf_gpt2_on_2x2() -> None:
    _check(gpt2, (2, 2))


def test_hf_gpt2_with_its_default_dropout_on_2x2() -> None:
    """Attention, residual and embedding dropout at GPT-2's 0.1: each rank draws the whole
    masks and keeps its piece, so training still equals one device's."""
    _check(lambda: gpt2(dropout=True), (2, 2))


def test_hf_llama_on_2() -> None:
    """A dense model: no warning about an experts implementation (every transformers 5
    config has one; only experts layers run it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*experts_implementation")
        _check(llama, (2,))


@pytest.mark.slow
def test_hf_llama_on_2x2() -> None:
    _check(llama, (2, 2))


def test_hf_mixtral_on_2() -> None:
    """The model as built, default experts implementation (grouped_mm, fp32): autopar traces
    the experts as batched_mm and says so once; the reference runs HF's own fp32 path."""
    with pytest.warns(UserWarning, match="experts_implementation='batched_mm'"):
        _check(mixtral, (2,))
    # the user's model keeps its own implementation
    model = mixtral()
    impl, kw = model.config._experts_implementation, inputs()
    with pytest.warns(UserWarning), fake_world(2):
        autopar.parallelize(model, mesh_for((2,)), example_kwargs=kw, time_limit_s=1.0)
    assert model.config._experts_implementation == impl


# --- the property: random configs, meshes and plans -------------------------------------------


@st.composite
def hf_cases(draw: st.DrawFn):
    """A Hugging Face model config, mesh, plan source and batch; sizes the mesh does not
    divide included (3 heads, a vocabulary of 50, an FFN width of 30, 3 experts, batch 6)."""
    kind = draw(st.sampled_from(["gpt2", "llama", "mixtral"]))
    heads = draw(st.sampled_from([2, 3, 4]))
    cfg = dict(kind=kind, heads=heads, head_dim=draw(st.sampled_from([4, 8])),
               kv_heads=draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0])),
               layers=draw(st.integers(1, 2)), vocab=draw(st.sampled_from([48, 50, 64])),
               # HF's own Mixtral experts (the single-device run) need 16-byte rows: 36, not 30
               inner=draw(st.sampled_from([24, 36 if kind == "mixtral" else 30, 64])),
               experts=draw(st.sampled_from([2, 3, 4])))
    mesh_shape = draw(st.sampled_from([(2,), (4,), (2, 2)]))
    return cfg, mesh_shape, draw(st.sampled_from(PLANS)), draw(st.sampled_from([4, 6]))


def _hf_model(kind: str, heads: int, head_dim: int, kv_heads: int, layers: int, vocab: int,
              inner: int, experts: int):
    hidden = heads * head_dim
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_positions=16, n_embd=hidden, n_layer=layers, n_head=heads,
            n_inner=inner, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inner,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, max_position_embeddings=16)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **common, num_local_experts=experts, num_experts_per_tok=min(2, experts)))


def _case(kind: str, heads: int, kv_heads: int, vocab: int, inner: int, experts: int,
          mesh_shape: tuple[int, ...], source: str) -> tuple:
    cfg = dict(kind=kind, heads=heads, head_dim=8, kv_heads=kv_heads, layers=2, vocab=vocab,
               inner=inner, experts=experts)
    return cfg, mesh_shape, source, 4


@settings(max_examples=max(1, EXAMPLES // 2), **SETTINGS)
@given(hf_cases())
# Megatron's layout on each family in every run (the draws may not reach one): GPT-2's
# Conv1D layers on 4 ranks, Llama's GQA with a vocabulary the mesh does not divide, Mixtral's
# experts split over tp
@example(_case("gpt2", 4, 4, 48, 24, 2, (4,), "megatron_tp"))
@example(_case("llama", 4, 2, 50, 64, 2, (2, 2), "dp_tp_2d"))
@example(_case("mixtral", 4, 1, 50, 36, 4, (2, 2), "dp_tp_2d"))
@pytest.mark.filterwarnings("ignore:autopar traces this model's experts")
def test_hf_models_equal_single_device(case) -> None:
    """Random GPT-2, Llama and Mixtral configs on random meshes, with the solver's plan or a
    reference layout (Megatron's on their own layers, see ``reference_plans``): three AdamW
    steps equal one device's, and the collectives run are the ones the plan predicted."""
    cfg, mesh_shape, source, batch = case
    torch.manual_seed(0)
    model = _hf_model(**cfg).train()
    ids = torch.randint(0, cfg["vocab"], (batch, 8))
    kw = {"input_ids": ids, "labels": ids}
    plan = None
    if source != "solver":
        plan = reference_plan(model, "hf", source, mesh_for(mesh_shape), (), kwargs=kw)
    what = f"{cfg} on {mesh_shape} with {source if plan is not None else 'solver'} plan"
    got, want, pm = run_case(model, (), mesh_shape, plan, time_limit_s=1.0, kwargs=kw)
    assert_same_training(got, want, what=what)
    check_collectives(got["collectives"][-1], pm, what)
