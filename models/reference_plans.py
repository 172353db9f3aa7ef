"""Hand-written reference layouts (DP, FSDP, Megatron TP, 2-D DP x TP) to score the solver against.

Each function takes ``(model, mesh_shape, axes, family)`` and returns a :class:`ReferencePlan`
naming a spec (one placement per mesh axis) for every entry of ``model.named_parameters()`` and
for each positional input (``0``: tokens or x, ``1``: targets or y; batch is dim 0), or ``None``
when the layout does not apply to the mesh. Rules for the tensor-parallel axis:

* ``megatron_tp``: the axis named ``"tp"``, or the only axis of a 1-D mesh; other axes replicate.
* ``dp_tp_2d``: needs an axis named ``"tp"`` and at least one other axis; every other axis is dp.

Family ``"hf"`` is a Hugging Face causal LM (GPT-2, Llama, Mixtral and the models built like
them), recognised by its modules' attributes: its inputs are its keyword inputs in call order
(``input_ids``, ``labels``), and tensor parallelism places its layers as Megatron does
(:func:`_hugging_face_layer`).

Every plan is valid on any mesh: a dim an axis does not divide is replicated on that axis, and
tensor parallelism is switched off per layer as a unit (column and row halves together) when
the heads, the FFN width, the experts or the vocabulary do not split evenly. Batch divisibility
is checked only when ``batch_size`` is passed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from torch import nn

from autopar.ir.placements import Placement, R, S, Spec, evenly_divides

from .gpt2 import GPT2, Block
from .llama3 import Attention, FeedForward, Transformer
from .mlp import MLP
from .moe import MoEFeedForward

FAMILIES = ("gpt2", "llama3", "moe", "mlp", "hf")
N_INPUTS = 2  # (tokens, targets) for LMs, (x, y) for the MLP


@dataclass(frozen=True, slots=True)
class ReferencePlan:
    name: str
    params: dict[str, Spec]
    inputs: dict[int, Spec]
    recompute: str = "none"  # the recomputation mode the layout runs with (passes.recompute)
    # the ZeRO stage of the parameters it stores split (the planner's reference_mode: "3"
    # re-gathers them in the backward, "2" keeps what the forward gathered, "1" also sums
    # gradients whole); None: as its recomputation mode implies (full re-gathers)
    zero: str | None = None


# the fixed memory policies `autopar plan --compare` scores beside the layouts: what people
# run when a model does not fit (torchtitan's FSDP with activation checkpointing per block,
# Megatron's tensor parallelism with selective recomputation, and the two together)
FIXED_POLICIES: dict[str, tuple[str, str]] = {
    "fsdp+full": ("fsdp", "full"),
    "megatron_tp+selective": ("megatron_tp", "selective"),
    "fsdp_tp_2d+full": ("fsdp_tp_2d", "full"),
}


# what `--compare` adds on a pipeline's stage mesh: Megatron-LM's layout (tensor parallel on
# "tp", pipeline stages, a distributed optimizer: parameters and optimizer state split over dp,
# gathered once per step and held whole across the microbatches, gradients reduce-scattered
# once per step), with selective and with full recomputation. The layout is fsdp_tp_2d's
# placement (fsdp's where the mesh has no "tp") at ZeRO stage 2, which inside a pipeline is
# the distributed optimizer (passes/problem/sharding_problem.mark_once_per_step).
PIPELINE_POLICIES: dict[str, tuple[str, str, str]] = {
    "megatron_distopt+selective": ("fsdp_tp_2d", "selective", "2"),
    "megatron_distopt+full": ("fsdp_tp_2d", "full", "2"),
}


PlanFn = Callable[..., "ReferencePlan | None"]


def data_parallel(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> ReferencePlan:
    """Replicated parameters; the batch split over the whole (flattened) mesh."""
    _check(mesh_shape, axes, family)
    n = len(mesh_shape)
    params = {name: (R,) * n for name, _ in model.named_parameters()}
    return ReferencePlan("data_parallel", params, _batch_inputs(mesh_shape, range(n), batch_size))


def fsdp(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> ReferencePlan:
    """ZeRO-3: parameter dim 0 split over each axis in turn while it divides; batch over all."""
    _check(mesh_shape, axes, family)
    n = len(mesh_shape)
    params = {
        name: _shard_dim0(tuple(p.shape), mesh_shape, range(n))
        for name, p in model.named_parameters()
    }
    return ReferencePlan("fsdp", params, _batch_inputs(mesh_shape, range(n), batch_size))


def megatron_tp(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> ReferencePlan | None:
    """Megatron column-then-row TP on the ``tp`` axis (or a 1-D mesh); inputs replicated."""
    _check(mesh_shape, axes, family)
    t = _tp_axis(axes)
    if t is None:
        return None
    params = _compose(model, mesh_shape, t, dp_axes=())
    inputs = {i: (R,) * len(mesh_shape) for i in range(N_INPUTS)}
    return ReferencePlan("megatron_tp", params, inputs)


def dp_tp_2d(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> ReferencePlan | None:
    """Megatron TP on ``tp``; parameters replicated on the other (dp) axes, batch split on them."""
    _check(mesh_shape, axes, family)
    if "tp" not in axes or len(axes) < 2:
        return None
    t = axes.index("tp")
    dp = [i for i in range(len(axes)) if i != t]
    params = _compose(model, mesh_shape, t, dp_axes=())
    return ReferencePlan("dp_tp_2d", params, _batch_inputs(mesh_shape, dp, batch_size))


def fsdp_tp_2d(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> ReferencePlan | None:
    """torchtitan's default for large models: :func:`dp_tp_2d` with parameters FSDP-sharded on dp.

    Dim 0 is split over the dp axes (outermost, as FSDP2 + TP nests them) before any TP split.
    """
    _check(mesh_shape, axes, family)
    if "tp" not in axes or len(axes) < 2:
        return None
    t = axes.index("tp")
    dp = [i for i in range(len(axes)) if i != t]
    params = _compose(model, mesh_shape, t, dp_axes=dp)
    return ReferencePlan("fsdp_tp_2d", params, _batch_inputs(mesh_shape, dp, batch_size))


REFERENCE_PLANS: dict[str, PlanFn] = {
    "data_parallel": data_parallel,
    "fsdp": fsdp,
    "megatron_tp": megatron_tp,
    "dp_tp_2d": dp_tp_2d,
    "fsdp_tp_2d": fsdp_tp_2d,
}


def applicable_plans(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None,
) -> dict[str, ReferencePlan]:
    """Every plan of :data:`REFERENCE_PLANS` that applies to this mesh, by name."""
    plans = {
        name: fn(model, mesh_shape, axes, family, batch_size=batch_size)
        for name, fn in REFERENCE_PLANS.items()
    }
    return {name: plan for name, plan in plans.items() if plan is not None}


def comparison_plans(
    model: nn.Module, mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str,
    batch_size: int | None = None, pipeline: bool = False,
) -> dict[str, ReferencePlan]:
    """What ``autopar plan --compare`` scores: every layout that applies to this mesh (one a
    model cannot take is left out), and each fixed memory policy of :data:`FIXED_POLICIES`
    whose layout applies; with ``pipeline`` (the mesh is a pipeline stage's), also
    :data:`PIPELINE_POLICIES`."""
    refs: dict[str, ReferencePlan] = {}
    for name, fn in REFERENCE_PLANS.items():
        try:
            ref = fn(model, mesh_shape, axes, family, batch_size=batch_size)
        except (ValueError, TypeError):
            ref = None
        if ref is not None:
            refs[name] = ref
    for name, (layout, mode) in FIXED_POLICIES.items():
        if layout in refs:
            refs[name] = replace(refs[layout], name=name, recompute=mode)
    if pipeline:
        refs.update(pipeline_policies(refs))
    return refs


def megatron_pipeline_layouts(model: nn.Module, mesh_shape: tuple[int, ...],
                              axes: tuple[str, ...]) -> dict[str, ReferencePlan]:
    """:data:`PIPELINE_POLICIES` on a pipeline stage's mesh, for any model these layouts take
    (a Hugging Face model by its own layers; the family matters to no other rule here).
    Empty where the stage mesh has no data-parallel axis of size > 1 (no optimizer to
    distribute)."""
    if not any(n > 1 and a != "tp" for n, a in zip(mesh_shape, axes)):
        return {}
    hf = any(type(m).__module__.startswith("transformers.") for m in model.modules())
    family = "hf" if hf else "llama3"
    base = {}
    for name in ("fsdp_tp_2d", "fsdp"):
        try:
            ref = REFERENCE_PLANS[name](model, mesh_shape, axes, family)
        except (ValueError, TypeError):
            ref = None
        if ref is not None:
            base[name] = ref
    return pipeline_policies(base)


def pipeline_policies(refs: dict[str, ReferencePlan]) -> dict[str, ReferencePlan]:
    """:data:`PIPELINE_POLICIES` laid out from the layouts ``refs`` holds (fsdp's where there
    is no fsdp_tp_2d: a stage mesh without "tp")."""
    out = {}
    for name, (layout, mode, zero) in PIPELINE_POLICIES.items():
        base = refs.get(layout) or refs.get("fsdp")
        if base is not None:
            out[name] = replace(base, name=name, recompute=mode, zero=zero)
    return out


# --- helpers -------------------------------------------------------------------------------


def _check(mesh_shape: tuple[int, ...], axes: tuple[str, ...], family: str) -> None:
    if len(mesh_shape) != len(axes):
        raise ValueError(
            f"mesh_shape {mesh_shape} has {len(mesh_shape)} axes but axes names {axes} has "
            f"{len(axes)}; give one name per mesh axis"
        )
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")


def _tp_axis(axes: tuple[str, ...]) -> int | None:
    if "tp" in axes:
        return axes.index("tp")
    return 0 if len(axes) == 1 else None


def _batch_inputs(
    mesh_shape: tuple[int, ...], dp_axes: Iterable[int], batch_size: int | None
) -> dict[int, Spec]:
    dp_axes = list(dp_axes)
    if batch_size is None:
        spec = tuple(S(0) if i in dp_axes else R for i in range(len(mesh_shape)))
    else:
        spec = _shard_dim0((batch_size,), mesh_shape, dp_axes)
    return {i: spec for i in range(N_INPUTS)}


def _shard_dim0(shape: tuple[int, ...], mesh_shape: tuple[int, ...], over: Iterable[int]) -> Spec:
    """``S(0)`` on each axis of ``over`` in mesh order while the remaining dim 0 still divides."""
    over = set(over)
    rest = shape[0] if shape else 1
    spec: list[Placement] = []
    for i, n in enumerate(mesh_shape):
        if i in over and shape and rest % n == 0:
            spec.append(S(0))
            rest //= n
        else:
            spec.append(R)
    return tuple(spec)


def _compose(
    model: nn.Module, mesh_shape: tuple[int, ...], t: int, dp_axes: Iterable[int]
) -> dict[str, Spec]:
    """Per-parameter specs: the TP placement on axis ``t``; dim-0 FSDP shards on ``dp_axes``."""
    tp_of = tensor_parallel_placements(model, mesh_shape[t])
    dp_axes = set(dp_axes)
    out: dict[str, Spec] = {}
    for name, p in model.named_parameters():
        shape, tp_p = tuple(p.shape), tp_of.get(name, R)
        # FSDP splits dim 0 first (outer), so it must leave a dim 0 that TP can still split.
        tp_div = mesh_shape[t] if tp_p == S(0) else 1
        spec: list[Placement] = [R] * len(mesh_shape)
        rest = shape[0] if shape else 0
        for i, n in enumerate(mesh_shape):
            if i in dp_axes and rest and rest % (n * tp_div) == 0:
                spec[i], rest = S(0), rest // n
        spec[t] = tp_p
        out[name] = _relax(shape, tuple(spec), mesh_shape, t)
    return out


def _relax(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...], t: int) -> Spec:
    """``spec`` if it splits evenly, else without its dp shards, else replicated."""
    tp_only = tuple(p if i == t else R for i, p in enumerate(spec))
    for cand in (spec, tp_only):
        if evenly_divides(shape, cand, mesh_shape):
            return cand
    return (R,) * len(mesh_shape)


def tensor_parallel_placements(model: nn.Module, tp: int) -> dict[str, Placement]:
    """The placement of each parameter on a tensor-parallel axis of size ``tp`` (absent: R)."""
    out: dict[str, Placement] = {}

    def put(prefix: str, pairs: dict[str, Placement]) -> None:
        out.update({f"{prefix}.{k}" if prefix else k: v for k, v in pairs.items()})

    if tp == 1:
        return out
    col, row, rep = S(0), S(1), R
    for prefix, m in model.named_modules():
        if isinstance(m, GPT2):
            if m.config.vocab_size % tp == 0:
                put(prefix, {"wte.weight": col})
        elif isinstance(m, Block):
            if m.attn.n_head % tp == 0:  # whole heads per rank (qkv rows are head-major)
                put(prefix, {"attn.qkv.weight": col, "attn.qkv.bias": col, "attn.proj.weight": row})
            if m.mlp.fc.out_features % tp == 0:
                put(prefix, {"mlp.fc.weight": col, "mlp.fc.bias": col, "mlp.proj.weight": row})
        elif isinstance(m, Transformer):
            if m.config.vocab_size % tp == 0:
                put(prefix, {"tok_embeddings.weight": col})
                if not m.config.tie_embeddings:
                    put(prefix, {"output.weight": col})
        elif isinstance(m, Attention):
            if m.n_heads % tp == 0:
                # Too few kv heads to split (tp > n_kv_heads): Megatron replicates them.
                kv = col if m.n_kv_heads % tp == 0 else rep
                put(prefix, {"wq.weight": col, "wk.weight": kv, "wv.weight": kv, "wo.weight": row})
        elif isinstance(m, FeedForward):
            if m.w1.out_features % tp == 0:
                put(prefix, {"w1.weight": col, "w3.weight": col, "w2.weight": row})
        elif isinstance(m, MoEFeedForward):
            if m.n_experts % tp == 0:  # expert parallel: whole experts per rank
                put(prefix, {"w1": S(0), "w3": S(0), "w2": S(0)})
            elif m.w1.shape[2] % tp == 0:  # fewer experts than ranks: split inside each expert
                put(prefix, {"w1": S(2), "w3": S(2), "w2": S(1)})
        elif (pairs := _hugging_face_layer(m, tp)) is not None:
            put(prefix, pairs)
        elif isinstance(m, MLP):
            layers = m.layers
            for i in range(0, len(layers) - 1, 2):
                if layers[i].out_features % tp == 0:
                    pair = {f"layers.{i}.weight": col, f"layers.{i + 1}.weight": row}
                    if layers[i].bias is not None:
                        pair[f"layers.{i}.bias"] = col
                    put(prefix, pair)
    return out


def _hugging_face_layer(m: nn.Module, tp: int) -> dict[str, Placement] | None:
    """Megatron's placements for a Hugging Face layer (recognised by its attributes, so no
    transformers import), ``{}`` where the layer's sizes do not split ``tp`` ways, ``None``
    for any other module. GPT-2's ``Conv1D`` holds its weight as ``[in, out]``, the transpose
    of ``nn.Linear``'s: its column split is ``S(1)``, its row split ``S(0)``."""
    col, row = S(0), S(1)
    cfg = getattr(m, "config", None)
    conv_col, conv_row = S(1), S(0)  # Conv1D: the output features are dim 1
    if hasattr(m, "c_attn") and hasattr(m, "c_proj"):  # GPT-2 attention
        if m.num_heads % tp:
            return {}
        return {"c_attn.weight": conv_col, "c_attn.bias": col, "c_proj.weight": conv_row}
    if hasattr(m, "c_fc") and hasattr(m, "c_proj"):  # GPT-2 MLP
        if m.c_fc.weight.shape[1] % tp:
            return {}
        return {"c_fc.weight": conv_col, "c_fc.bias": col, "c_proj.weight": conv_row}
    if hasattr(m, "wte") and hasattr(m, "h"):  # GPT-2's embeddings (tied to its LM head)
        return {"wte.weight": col} if m.wte.weight.shape[0] % tp == 0 else {}
    if hasattr(m, "q_proj") and hasattr(m, "o_proj") and cfg is not None:  # Llama attention
        if cfg.num_attention_heads % tp:
            return {}
        kv = col if cfg.num_key_value_heads % tp == 0 else R  # too few kv heads: replicated
        return {"q_proj.weight": col, "k_proj.weight": kv, "v_proj.weight": kv,
                "o_proj.weight": row}
    if hasattr(m, "gate_proj") and hasattr(m, "down_proj") and hasattr(m, "up_proj"):
        if m.gate_proj.weight.shape[0] % tp:  # a SwiGLU MLP
            return {}
        return {"gate_proj.weight": col, "up_proj.weight": col, "down_proj.weight": row}
    experts = getattr(m, "gate_up_proj", None)
    if isinstance(experts, nn.Parameter) and hasattr(m, "down_proj"):  # fused experts
        # expert parallel: whole experts per rank ([experts, ...] weights)
        return {"gate_up_proj": S(0), "down_proj": S(0)} if experts.shape[0] % tp == 0 else {}
    if hasattr(m, "embed_tokens") and hasattr(m, "layers"):  # Llama's embeddings
        return {"embed_tokens.weight": col} if m.embed_tokens.weight.shape[0] % tp == 0 else {}
    head = getattr(m, "lm_head", None)
    if isinstance(head, nn.Linear) and cfg is not None:  # an untied LM head: vocab parallel
        tied = getattr(cfg, "tie_word_embeddings", False)
        return {"lm_head.weight": col} if not tied and head.out_features % tp == 0 else {}
    return None
