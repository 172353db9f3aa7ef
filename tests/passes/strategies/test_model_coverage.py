"""Every op in the joint graphs of the supported models has a sharding rule, and the rules hold.

Models: Hugging Face GPT-2, Llama and Mixtral from tiny configs (SDPA and eager attention), and
the ``autopar.models`` presets. Each is captured on the meta device (nothing allocated) with
``autopar.capture.joint``; then

- no node reports a missing rule on a 1-D or 2-D mesh, and every strategy places exactly the
  node's tensor inputs and outputs;
- the layouts the hand-written plans rely on are offered (vocab-parallel embedding, head-split
  attention, expert-parallel experts);
- on real random values, every strategy of every data-movement node (views, indexing,
  embedding, attention, MoE families) is validated against the full-tensor result, with the
  arguments exactly as the real graph has them (``-1`` sizes, ``INT_MAX`` slice ends...).

HF Mixtral: transformers 5.x picks the experts implementation by ``experts_implementation``.
Its ``"eager"`` loop calls ``nonzero()`` and iterates over the experts that were hit (a
data-dependent shape and Python control flow on values): it cannot be traced on fake tensors,
so capture traces ``batched_mm`` in its place (``autopar.capture.hf_experts``).
``"batched_mm"`` gathers each token's expert weights with ``w[expert_ids]`` and runs ``bmm``:
static shapes, traced here in fp32. ``"grouped_mm"`` (the default) sorts tokens by expert and
calls ``torch._grouped_mm``, whose fake-tensor kernel accepts bf16 only: traced here in bf16.
"""

from __future__ import annotations

import functools
import importlib.util
import operator
import warnings

import pytest
import torch
import torch.fx as fx

from autopar.capture.joint import capture
from autopar.ir.graph import PlanGraph
from autopar.ir.placements import Partial, R, Shard
from autopar.passes.strategies import simulate
from autopar.passes.strategies.registry import (
    node_strategies,
    op_info,
    rule_fn,
    tensor_inputs,
)

aten = torch.ops.aten
P = Partial("sum")
HAS_HF = importlib.util.find_spec("transformers") is not None
VOCAB = 128
DATA_FAMILIES = {"views", "indexing", "embedding", "attention", "moe", "misc"}


def _hf_model(kind: str, attn: str, experts: str = "batched_mm", dtype=torch.float32,
              small: bool = False):
    import transformers as T

    T.logging.set_verbosity_error()
    dim, ffn = (32, 32) if small else (64, 128)
    if kind == "gpt2":
        cfg = T.GPT2Config(n_layer=2, n_embd=dim, n_head=4, vocab_size=VOCAB, n_positions=64,
                           bos_token_id=0, eos_token_id=0)
        cls = T.GPT2LMHeadModel
    elif kind == "llama":
        cfg = T.LlamaConfig(num_hidden_layers=2, hidden_size=dim, intermediate_size=ffn,
                            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                            max_position_embeddings=64)
        cls = T.LlamaForCausalLM
    else:
        cfg = T.MixtralConfig(num_hidden_layers=2, hidden_size=dim, intermediate_size=ffn,
                              num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                              max_position_embeddings=64, num_local_experts=4,
                              num_experts_per_tok=2, experts_implementation=experts,
                              output_router_logits=True)  # the load-balancing loss too
        cls = T.MixtralForCausalLM
    cfg._attn_implementation = attn
    with torch.device("meta"):
        model = cls(cfg).to(dtype)
    return model


@functools.cache
def hf_graph(kind: str, attn: str, experts: str = "batched_mm", dtype=torch.float32,
             small: bool = False) -> PlanGraph:
    model = _hf_model(kind, attn, experts, dtype, small)
    seq = 8 if small else 16
    ids = torch.randint(0, VOCAB, (2, seq), device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return capture(model, (), {"input_ids": ids, "labels": ids})


@functools.cache
def preset_graph(name: str) -> PlanGraph:
    try:
        from autopar.models import get_preset
    except ImportError as e:  # pragma: no cover - while models/ is being written
        pytest.skip(f"autopar.models is not importable yet: {e}")
    try:
        preset = get_preset(name)
    except KeyError:
        pytest.skip(f"preset {name!r} does not exist yet")
    return capture(preset.build(device="meta"), preset.example_inputs(2, 16))


HF_CASES = [(k, a) for k in ("gpt2", "llama", "mixtral") for a in ("sdpa", "eager")]
PRESETS = ["gpt2-tiny", "llama3-tiny", "moe-tiny", "mlp-tiny"]


def _graph(case) -> PlanGraph:
    if isinstance(case, str):
        return preset_graph(case)
    if not HAS_HF:
        pytest.skip("transformers is not installed")
    return hf_graph(*case)


ALL_CASES = HF_CASES + [("mixtral", "sdpa", "grouped_mm", torch.bfloat16)] + PRESETS


def _id(case) -> str:
    return case if isinstance(case, str) else "-".join(str(c).removeprefix("torch.") for c in case)


def _calls(pg: PlanGraph) -> list[fx.Node]:
    return [n for n in pg.gm.graph.nodes if n.op == "call_function"]


# --- coverage --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ALL_CASES, ids=_id)
def test_every_op_has_a_rule(case):
    pg = _graph(case)
    missing: dict[str, int] = {}
    for node in _calls(pg):
        # a getitem places the producer's output it picks (not a tensor node of its own)
        n_in = 1 if node.target is operator.getitem else len(tensor_inputs(node))
        n_out = len(node.meta["autopar"].outputs)
        for mesh in ((2,), (2, 2)):
            res = node_strategies(node, mesh)
            if res.missing_rule:
                missing[str(node.target)] = missing.get(str(node.target), 0) + 1
            for s in res.strategies:
                assert len(s.ins) == n_in and len(s.outs) == n_out, (node.format_node(), s)
    assert not missing, f"ops with no sharding rule: {missing}"


# --- the layouts reference plans rely on -----------------------------------------------------


def _offers(pg: PlanGraph, op, pred) -> bool:
    return any(pred(s) for n in _calls(pg) if n.target == op
               for s in node_strategies(n, (2,)).strategies)


@pytest.mark.parametrize("case", [c for c in ALL_CASES if c != "mlp-tiny"], ids=_id)
def test_lm_key_layouts(case):
    pg = _graph(case)
    assert _offers(pg, aten.embedding.default,
                   lambda s: "vocab_parallel_embedding" in s.impls and s.outs[0] == (P,))
    assert _offers(pg, aten.embedding_dense_backward.default,
                   lambda s: s.outs[0] == (Shard(0),))
    sdpa = aten._scaled_dot_product_flash_attention_for_cpu.default
    if any(n.target == sdpa for n in _calls(pg)):
        assert _offers(pg, sdpa, lambda s: s.ins[0] == s.outs[0] == (Shard(1),))
        assert _offers(pg, sdpa, lambda s: s.ins[0] == s.outs[0] == (Shard(0),))


def test_moe_preset_expert_parallel():
    pg = preset_graph("moe-tiny")
    from autopar.models import get_preset

    n_exp = get_preset("moe-tiny").config.n_experts
    expert_bmms = [n for n in _calls(pg) if n.target == aten.bmm.default
                   and n.meta["val"].shape[0] == n_exp]
    assert expert_bmms, "the stacked-expert bmm is not in the graph"
    for n in expert_bmms:
        strategies = node_strategies(n, (2,)).strategies
        assert any(s.ins == ((Shard(0),), (Shard(0),)) and s.outs == ((Shard(0),),)
                   for s in strategies), n.format_node()


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_mixtral_batched_mm_expert_parallel():
    pg = hf_graph("mixtral", "sdpa")
    # gate_up_proj[expert_ids]: each rank gathers from its own experts, zeros elsewhere
    assert _offers(pg, aten.index.Tensor,
                   lambda s: "masked_index" in s.impls and s.outs[0] == (P,))
    assert _offers(pg, aten.index_put.default,
                   lambda s: "masked_index_put" in s.impls and s.outs[0] == (Shard(0),))


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_mixtral_grouped_mm_expert_parallel():
    pg = hf_graph("mixtral", "sdpa", "grouped_mm", torch.bfloat16)
    gmm = aten._grouped_mm.default
    # forward and input gradient: experts split, output a Partial sum over the ranks' experts
    assert _offers(pg, gmm, lambda s: "expert_grouped_mm" in s.impls and s.outs[0] == (P,))
    # weight gradient: comes out split by expert, like the weight
    assert _offers(pg, gmm, lambda s: "expert_grouped_mm" in s.impls
                   and s.outs[0] == (Shard(0),))


@pytest.mark.skipif(not HAS_HF, reason="transformers is not installed")
def test_hf_mixtral_eager_experts_are_traced_as_batched_mm():
    """The eager loop cannot be traced (``nonzero``): capture traces the static ``batched_mm``
    instead, says so, and leaves the model's own setting as it was."""
    model = _hf_model("mixtral", "sdpa", experts="eager")
    ids = torch.randint(0, VOCAB, (2, 16), device="meta")
    with pytest.warns(UserWarning, match="batched_mm.*instead of 'eager'"):
        pg = capture(model, (), {"input_ids": ids, "labels": ids})
    assert model.config._experts_implementation == "eager"
    ops = {n.target for n in pg.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.bmm.default in ops
    assert torch.ops.aten.nonzero.default not in ops


# --- rules validated on the real graphs' arguments -------------------------------------------


def _real_inputs(pg: PlanGraph, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for n in pg.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        v = n.meta["val"]
        if v.dtype in (torch.int64, torch.int32):
            out.append(torch.randint(0, 64, tuple(v.shape), dtype=v.dtype, generator=gen))
        else:
            out.append((torch.randn(tuple(v.shape), generator=gen) * 0.1).to(v.dtype))
    return out


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


class _RuleChecker(fx.Interpreter):
    """Runs the graph on real values; before each data-movement node, validates every one of
    its strategies on clones of the node's actual arguments."""

    def __init__(self, gm: fx.GraphModule, mesh: tuple[int, ...], tol: float = 1e-4) -> None:
        super().__init__(gm)
        self.mesh, self.tol = mesh, tol
        self.checked = 0
        self.failures: list[str] = []

    def run_node(self, n: fx.Node):
        fn = rule_fn(n.target) if n.op == "call_function" else None
        if fn is not None and fn.__module__.rsplit(".", 1)[-1] in DATA_FAMILIES:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            info = op_info(n)
            for s in node_strategies(n, self.mesh).strategies:
                try:
                    simulate.check_strategy(n.target, _clone(args), _clone(kwargs), info, s,
                                            self.mesh, atol=self.tol, rtol=self.tol)
                except Exception as e:  # collect all, report together
                    self.failures.append(f"{n.format_node()} under {s}: {e!r}"[:400])
                self.checked += 1
        return super().run_node(n)


VALUE_CASES = [("gpt2", "sdpa", "batched_mm", torch.float32, True),
               ("llama", "sdpa", "batched_mm", torch.float32, True),
               ("mixtral", "eager", "batched_mm", torch.float32, True),
               ("mixtral", "sdpa", "grouped_mm", torch.bfloat16)] + PRESETS


@pytest.mark.parametrize("case", VALUE_CASES, ids=_id)
@pytest.mark.parametrize("mesh", [(2,), (2, 2)], ids=["2", "2x2"])
def test_data_rules_hold_on_real_graphs(case, mesh):
    if not isinstance(case, str) and mesh == (2, 2) and case[0] == "mixtral":
        # 1-D only: slow for little gain, and in bf16 the simulator's replica check (fixed
        # 1e-5 tolerance) trips on the rounding of differently split Partials
        pytest.skip("checked on the 1-D mesh")
    pg = _graph(case)
    bf16 = not isinstance(case, str) and len(case) > 3 and case[3] == torch.bfloat16
    checker = _RuleChecker(pg.gm, mesh, tol=3e-2 if bf16 else 1e-4)
    checker.run(*_real_inputs(pg, torch.Generator().manual_seed(0)))
    assert checker.checked > 0
    assert not checker.failures, "\n".join(checker.failures[:10])


def test_replicated_is_always_offered():
    pg = preset_graph("llama3-tiny")
    for n in _calls(pg)[:200]:
        res = node_strategies(n, (2,))
        assert any(all(spec == (R,) for spec in s.ins + s.outs) for s in res.strategies)
