"""``parallelize(..., compile=True)``: runs of plain steps compiled by Inductor
(``runtime/inductor_segments.py``). Where the runs are cut, what a run reads, hands out and
frees, and that a compiled program trains as the eager one does. The multi-process runs (the
collectives between compiled runs) are in ``test_gloo.py::test_gloo_compiled_program``."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from harness.spmd import assert_same_training, rel_err, train_parallel, train_single

import autopar
from autopar.ir.mesh import Mesh
from autopar.models import get_preset
from autopar.runtime.inductor_segments import CompiledRun, fusible, runs
from autopar.runtime.step_code import _template

aten = torch.ops.aten


def _step(name: str, target=aten.relu.default, reads=(), free_after=(), val=None,
          getitem_of: tuple[str, int] | None = None) -> SimpleNamespace:
    """A lowered step as ``CompiledRun`` and ``runs`` see it (``lower._Step``'s fields)."""
    g = fx.Graph()
    node = g.call_function(target, ())
    node.meta["val"] = torch.empty(2) if val is None else val
    if getitem_of is not None:
        inputs = [SimpleNamespace(producer=getitem_of[0], item=getitem_of[1])]
        return SimpleNamespace(name=name, node=node, is_getitem=True, inputs=inputs,
                               free_after=list(free_after), args=(), kwargs={}, flat=[],
                               localized=None)
    inputs = [SimpleNamespace(producer=r, item=None) for r in reads]
    return SimpleNamespace(name=name, node=node, is_getitem=False, inputs=inputs,
                           free_after=list(free_after), args=(None,) * len(reads), kwargs={},
                           flat=list(range(len(reads))), localized=None)


def test_runs_are_cut_at_unplain_steps_and_gradient_sync_launches() -> None:
    steps = [_step(f"s{k}") for k in range(9)]
    plain = {k: k != 4 for k in range(9)}
    by_name = {s.name: k for k, s in enumerate(steps)}
    got = runs(steps, lambda s: plain[by_name[s.name]], launches={1})
    # 0-1 (cut after the launch at 1), 2-3 (cut by the general-path step 4), 5-8
    assert got == {0: 2, 2: 4, 5: 9}


def test_a_run_of_one_op_stays_eager_and_getitems_do_not_count() -> None:
    pair = torch.empty(2), torch.empty(2)
    steps = [_step("ln", aten.native_layer_norm.default, val=pair),
             _step("g0", getitem_of=("ln", 0)), _step("g1", getitem_of=("ln", 1)),
             _step("x", aten.bernoulli.default),  # random: eager, to match one device
             _step("a"), _step("b")]
    assert not fusible(steps[3])
    assert runs(steps, lambda s: True) == {4: 6}


def test_attention_joins_a_run_only_without_dropout() -> None:
    def sdpa(p: float) -> SimpleNamespace:
        s = _step("attn", aten._scaled_dot_product_flash_attention_for_cpu.default)
        s.node.args = (None, None, None, p)  # (query, key, value, dropout_p)
        return s

    assert fusible(sdpa(0.0)) and not fusible(sdpa(0.1))


def test_a_run_reads_hands_out_and_frees_what_the_program_around_it_needs() -> None:
    # mm = x @ w; r = relu(mm); s = sum(r): mm is made and last read inside the run, x is
    # made before it and last read inside it, r and s are read after it
    steps = [_step("mm", aten.mm.default, reads=("x", "w"), free_after=("x",)),
             _step("r", aten.relu.default, reads=("mm",), free_after=("mm",)),
             _step("s", aten.sum.default, reads=("r",))]
    run = CompiledRun(steps, _template)
    assert run.reads == [("x", None), ("w", None)]
    assert run.writes == [("r", None), ("s", None)]
    assert run.frees == ["x"]
    assert run.code("G0", lambda p, i: f"env[{p!r}]") == [
        "    _o = G0(env['x'], env['w'], )", "    env['r'] = _o[0]", "    env['s'] = _o[1]"]
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    r, s = run(x, w)
    torch.testing.assert_close(r, torch.relu(x @ w))
    torch.testing.assert_close(s, torch.relu(x @ w).sum())
    # other strides (a transposed input): compiled again for them, not run on wrong ones
    xt = torch.randn(4, 8).t()
    r2, _ = run(xt, w)
    torch.testing.assert_close(r2, torch.relu(xt @ w))
    assert len(run._compiled) == 2


def test_a_run_inductor_cannot_compile_runs_eagerly_with_a_warning(monkeypatch) -> None:
    import torch._inductor

    def fails(gm, args):
        raise RuntimeError("no C++ compiler found\nmore detail")

    monkeypatch.setattr(torch._inductor, "compile", fails)
    steps = [_step("mm", aten.mm.default, reads=("x", "w")),
             _step("r", aten.relu.default, reads=("mm",), free_after=("mm",))]
    run = CompiledRun(steps, _template)
    x, w = torch.randn(8, 4), torch.randn(4, 3)
    with pytest.warns(UserWarning, match=r"2 steps from 'mm'.*aten\.mm\.default.*runs "
                      r"eagerly: RuntimeError: no C\+\+ compiler found\. "
                      r"parallelize\(\.\.\., compile=False\)"):
        got = run(x, w)
    torch.testing.assert_close(got[0], torch.relu(x @ w))


@pytest.fixture
def one_rank_group():
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_compiled_gpt_trains_as_one_device(one_rank_group) -> None:
    """Views, layer norms, attention (its kernel called without dropout), embeddings, ``cat``
    and the loss through Inductor, on one rank: no collectives, so the forward is one run and
    the backward one after its seed step."""
    preset = get_preset("gpt2-tiny").replace(n_positions=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(4, 8, device="cpu")
    want = train_single(copy.deepcopy(model), inputs, 3)
    pm = autopar.parallelize(model, Mesh((1,), ("dp",), "cpu"), inputs, compile=True)
    assert_same_training(train_parallel(pm, inputs, 3), want, what="compiled")
    programs = list(pm._active[1]._compiled.values())
    assert [len(p.compiled_runs) for p in programs] == [1, 1]
    assert all(p.source.count("X(S[") == n for p, n in zip(programs, (0, 1)))
    assert all(r._compiled for p in programs for r in p.compiled_runs)


@pytest.mark.parametrize("build", ["gpt2", "llama", "mixtral"])
def test_hugging_face_models_compiled_train_as_one_device(build: str, one_rank_group) -> None:
    """The Hugging Face causal LMs of ``harness.hf`` (rotary embeddings, grouped-query attention,
    the MoE's routing) through Inductor: no run falls back to eager, and three AdamW steps
    equal one device's."""
    pytest.importorskip("transformers")
    import warnings

    from harness import hf

    torch.manual_seed(0)
    model = getattr(hf, build)().train()
    kw = hf.inputs()
    ref = copy.deepcopy(model)
    want = [loss.item() for loss in hf.train_steps(lambda: ref(**kw).loss, ref.parameters())]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="Inductor could not compile")
        pm = autopar.parallelize(model, Mesh((1,), ("dp",), "cpu"), example_kwargs=kw,
                                 compile=True)
        got = [loss.item() for loss in hf.train_steps(lambda: pm(**kw), pm.parameters())]
    assert got == pytest.approx(want, rel=1e-5)
    for (name, p), q in zip(pm.named_parameters(), ref.parameters()):
        assert rel_err(p.detach().full_tensor(), q.detach()) < 1e-5, name
    assert all(r._compiled for p in pm._active[1]._compiled.values() for r in p.compiled_runs)
