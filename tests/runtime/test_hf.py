"""Hugging Face causal LMs built from small configs, parallelized unmodified (simulated mesh).

The model is called with keyword inputs (``input_ids=..., labels=...``) and returns an output
object with ``.loss``; autopar traces that as it is.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from spmd_harness import EPS, LR, RNG_SEED, _whole, fake_world, mesh_for, reconcile, rel_err

import autopar

transformers = pytest.importorskip("transformers")


def _gpt2(dropout: bool = False):
    pdrop = {} if dropout else dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  **pdrop)  # with dropout: GPT-2's own 0.1 everywhere
    return transformers.GPT2LMHeadModel(cfg)


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=16)
    return transformers.LlamaForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=16,
                                     num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def _kw() -> dict[str, torch.Tensor]:
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


def _check(build, mesh_shape) -> None:
    torch.manual_seed(0)
    model = build().train()
    kw = _kw()
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
    _check(_gpt2, (2, 2))


def test_hf_gpt2_with_its_default_dropout_on_2x2() -> None:
    """Attention, residual and embedding dropout at GPT-2's 0.1: each rank draws the whole
    masks and keeps its piece, so training still equals one device's."""
    _check(lambda: _gpt2(dropout=True), (2, 2))


def test_hf_llama_on_2() -> None:
    _check(_llama, (2,))


@pytest.mark.slow
def test_hf_llama_on_2x2() -> None:
    _check(_llama, (2, 2))


def test_hf_mixtral_on_2() -> None:
    """The model as built, default experts implementation (grouped_mm, fp32): autopar traces
    the experts as batched_mm and says so once; the reference runs HF's own fp32 path."""
    with pytest.warns(UserWarning, match="experts_implementation='batched_mm'"):
        _check(_mixtral, (2,))
    # the user's model keeps its own implementation
    model = _mixtral()
    impl, kw = model.config._experts_implementation, _kw()
    with pytest.warns(UserWarning), fake_world(2):
        autopar.parallelize(model, mesh_for((2,)), example_kwargs=kw, time_limit_s=1.0)
    assert model.config._experts_implementation == impl
