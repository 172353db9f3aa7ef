"""Stage modules for pipeline parallelism: a model cut into contiguous ranges of its blocks.

A stage is a range ``[a, b)`` of the model's repeated blocks (its largest ``nn.ModuleList`` of
one block type); the embedding goes with the first stage, the final norm and the LM head with
the last, and the loss is computed from the last stage's output by a parameter-free function
(the schedule's ``loss_fn``). The loss cannot be inside the last stage: torch's stages receive
only activations from the stage before, never a model input such as the targets.

Two ways to build the stage modules, both giving modules whose parameter names are the whole
model's (``layers.3.attention.wq.weight``), so stage state maps back to the single-device model:

* ``"trace"``: torch's own splitter (``torch.distributed.pipelining.pipeline``, which exports
  the model with ``torch.export`` and cuts the graph before the first block of each stage).
  Works for models that export and whose stages read only the stage before: autopar's GPT-2,
  Llama-3 on 2 stages, Hugging Face GPT-2. Refused when the stages are built (not in the
  first step) where torch 2.13's stages cannot run the cut: a value read past the next stage
  (Llama's RoPE tables from 3 stages on) or a submodule call whose inputs the splitter drops
  (Hugging Face Llama's ``rotary_emb``).
* ``"module"``: stage modules written here for autopar's own model families (GPT-2, Llama-3,
  MoE), and in :mod:`.hf_stages` for Hugging Face Llama-style decoders (each stage makes its
  own rotary tables and causal mask), which run the model's own submodules in order. The MoE
  family needs it: its loss adds a load-balancing term summed over every layer, which the
  traced logits-only forward drops, so each stage here passes the running sum on beside the
  hidden state.

A weight used by two stages (GPT-2's embedding tied to its head) becomes one copy per stage;
the runner sums their gradients (:func:`tied_names` finds them).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.capture.joint import callable_module, called_parts
from autopar.ir.blocks import PipelineBlocks, pipeline_blocks
from autopar.ir.errors import PlanError
from autopar.runtime.pipeline.planned_stage import BlockCalls

Ranges = tuple[tuple[int, int], ...]


# --- where the blocks are, and how they are split --------------------------------------------


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's repeated blocks: its largest ``nn.ModuleList`` whose children share a type
    (``blocks`` in GPT-2, ``layers`` in Llama, ``transformer.h`` / ``model.layers`` in Hugging
    Face models); the one a model names itself where it implements the blocks protocol
    (:mod:`autopar.ir.blocks`)."""
    own = pipeline_blocks(model)
    if own is not None:
        return own.blocks, model.get_submodule(own.blocks)
    best: tuple[str, nn.ModuleList] | None = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and len({type(c) for c in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        raise PlanError(
            f"{type(model).__name__} has no nn.ModuleList of repeated blocks to cut into pipeline "
            "stages: keep the layers in one nn.ModuleList, or run without pipeline parallelism")
    return best


def stage_ranges(split: Sequence[int] | Sequence[tuple[int, int]] | None, n_blocks: int,
                 n_stages: int) -> Ranges:
    """Each stage's block range ``[a, b)``, from ``split`` given as blocks per stage
    (``[3, 3, 2]``), as ranges (``[(0, 3), (3, 6), (6, 8)]``) or ``None`` (as even as can be,
    the earlier stages one block longer)."""
    if n_stages < 1:
        raise PlanError(f"a pipeline needs at least one stage, got {n_stages}")
    if n_stages > n_blocks:
        raise PlanError(
            f"{n_stages} pipeline stages but the model has only {n_blocks} blocks: every stage "
            f"needs at least one block; use at most {n_blocks} stages (pp x virtual stages per "
            "rank), or a deeper model")
    if split is None:
        q, r = divmod(n_blocks, n_stages)
        split = [q + (i < r) for i in range(n_stages)]
    items = list(split)
    if items and all(isinstance(s, (tuple, list, range)) for s in items):
        ranges = tuple((int(s[0]), int(s[-1]) + 1) if isinstance(s, range) else
                       (int(s[0]), int(s[1])) for s in items)
    else:
        bounds = [0]
        for s in items:
            bounds.append(bounds[-1] + int(s))
        ranges = tuple(zip(bounds[:-1], bounds[1:]))
    if len(ranges) != n_stages:
        raise PlanError(f"the split {list(split)} has {len(ranges)} stages but the pipeline has "
                        f"{n_stages} (pp x virtual stages per rank): give one entry per stage")
    contiguous = ranges[0][0] == 0 and ranges[-1][1] == n_blocks and all(
        a < b for a, b in ranges) and all(p[1] == q[0] for p, q in zip(ranges, ranges[1:]))
    if not contiguous:
        raise PlanError(
            f"the split {list(split)} does not cover the model's {n_blocks} blocks in order with "
            "at least one block per stage: give contiguous ranges [a, b) from 0 to "
            f"{n_blocks}, or blocks per stage summing to {n_blocks}")
    return ranges


def check_batch(batch: int, dp: int, n_microbatches: int) -> int:
    """The micro-batch size; a batch that does not split evenly over ``dp`` x micro-batches is
    refused, since unequal micro-batches would weigh their mean losses unequally."""
    if n_microbatches < 1:
        raise PlanError(f"n_microbatches must be at least 1, got {n_microbatches}")
    if batch % (dp * n_microbatches):
        raise PlanError(
            f"a batch of {batch} does not split into {dp} data-parallel shares of "
            f"{n_microbatches} equal micro-batches: use a batch that is a multiple of "
            f"{dp * n_microbatches}, or a number of micro-batches that divides {batch // dp}"
            if batch % dp == 0 else
            f"a batch of {batch} does not split over {dp} data-parallel replicas: use a batch "
            f"that is a multiple of {dp * n_microbatches} (dp x micro-batches)")
    return batch // (dp * n_microbatches)


def alias_names(model: nn.Module) -> dict[str, str]:
    """Each name of a parameter the model holds under several names (Hugging Face's tied
    ``lm_head.weight`` and ``transformer.wte.weight``) -> its first name."""
    first: dict[int, str] = {}
    out: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canon = first.setdefault(id(p), name)
        out[name] = canon
    counts: dict[str, int] = {}
    for canon in out.values():
        counts[canon] = counts.get(canon, 0) + 1
    return {n: c for n, c in out.items() if counts[c] > 1}


def tied_names(stage_params: dict[int, list[str]], aliases: dict[str, str]
               ) -> dict[str, list[int]]:
    """Weights held as more than one copy over the stages (a tied embedding and head, under
    one name or, traced, under each of its names), by first name, with the stages holding
    a copy. ``stage_params``: each stage's parameter names, duplicates included."""
    copies: dict[str, list[int]] = {}
    for s, names in sorted(stage_params.items()):
        for name in names:
            copies.setdefault(aliases.get(name, name), []).append(s)
    return {n: sorted(set(h)) for n, h in copies.items() if len(h) > 1}


# --- the loss ---------------------------------------------------------------------------------


def is_hf_model(model: nn.Module) -> bool:
    """A Hugging Face model (its ``config`` has ``to_dict``): its own next-token loss."""
    return hasattr(model, "config") and hasattr(model.config, "to_dict")


def loss_fn_for(model: nn.Module) -> Callable[[Any, torch.Tensor], torch.Tensor]:
    """The model's own mean loss from the last stage's output and the micro-batch's targets:
    autopar's models' cross-entropy over fp32 logits (plus the MoE balance term, which the
    module frontend passes on as the output's second element); Hugging Face's next-token
    cross-entropy (labels shifted by one, ``-100`` ignored)."""
    if is_hf_model(model):
        def hf_loss(out: Any, labels: torch.Tensor) -> torch.Tensor:
            logits = _first(out).float()
            return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return hf_loss
    coef = getattr(getattr(model, "config", None), "aux_loss_coef", None)
    n_layers = len(find_blocks(model)[1])

    def lm_loss(out: Any, targets: torch.Tensor) -> torch.Tensor:
        logits = _first(out)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        if coef is not None and isinstance(out, (tuple, list)):
            loss = loss + coef * out[1] / n_layers
        return loss
    return lm_loss


def _first(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        return out["logits"]
    return out[0]


# --- frontend "trace": torch's splitter ------------------------------------------------------


def traced_stages(model: nn.Module, mb_example: tuple, block_path: str, ranges: Ranges,
                  local: Sequence[int]) -> tuple[dict[int, nn.Module], Any]:
    """The local stage modules cut by ``torch.distributed.pipelining.pipeline``, and the
    pipe's info for ``build_stage``: every rank traces the whole model on a micro-batch's
    shapes; the cut is before each stage's first block."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    blocks = model.get_submodule(block_path)
    split_spec = {block_entry(blocks, block_path, a): SplitPoint.BEGINNING for a, _ in ranges[1:]}
    with _export_friendly(model), warnings.catch_warnings():
        # torch's own splitter deep-copies pytree specs through a deprecated isinstance check
        # (torch 2.13); nothing the user can act on
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`",
                                category=FutureWarning)
        pipe = pipeline(model, mb_args=mb_example, split_spec=split_spec)
    if pipe.num_stages != len(ranges):
        raise PlanError(
            f"torch's splitter made {pipe.num_stages} stages where {len(ranges)} were asked: "
            "the model's blocks are not called in order in its forward; use frontend='module'")
    _check_chain(pipe.split_gm.graph)
    mods = {s: pipe.get_stage_module(s) for s in local}
    for s in range(pipe.num_stages):  # every rank decides alike, so check every stage
        _check_calls(pipe.get_stage_module(s), s)
    _untie_local(mods)
    return mods, pipe.info()


def block_entry(blocks: nn.ModuleList, block_path: str, index: int) -> str:
    """The module whose call starts block ``index``: the block itself, or, for a block the
    forward never calls as a whole (an ``nn.ModuleDict`` whose members it calls,
    ``blk["attn"](x)``), its first member, which the forward must call first."""
    block = blocks[index]
    if callable_module(block):
        return f"{block_path}.{index}"
    first = called_parts(block)
    if not first:
        raise PlanError(f"{block_path}.{index} holds no module the forward calls: a pipeline "
                        "stage starts at a module call")
    name = next(n for n, m in block.named_modules() if m is first[0])
    return f"{block_path}.{index}.{name}"


def _check_chain(graph: Any) -> None:
    """Each traced stage must read only the stage before it: torch's stages cannot send a value
    past a stage (forward or backward). Llama's RoPE tables, computed before the first block
    and read by every block, are such a value once there are three stages or more."""
    import operator

    stages = [n for n in graph.nodes if n.op == "call_module"]
    for k, node in enumerate(stages[1:], start=1):
        for arg in node.args:
            while getattr(arg, "target", None) is operator.getitem:
                arg = arg.args[0]
            if arg is not stages[k - 1]:
                src = arg.name if arg.op != "call_module" else f"stage {stages.index(arg)}"
                raise SkipConnectionError(
                    f"traced stage {k} reads a value from {src}, not only from stage {k - 1}: "
                    "torch's pipeline stages pass values to the next stage only; use "
                    "frontend='module' (autopar's models) or fewer stages")


def _check_calls(mod: nn.Module, stage: int) -> None:
    """Every submodule call inside a traced stage passes as many inputs as the submodule's
    graph takes. torch 2.13's splitter can drop them: Hugging Face Llama's ``rotary_emb``,
    called on position ids computed in its parent, loses its inputs and would fail in the
    first step."""
    for owner, sub in mod.named_modules():
        graph = getattr(sub, "graph", None)
        if graph is None:
            continue
        for node in graph.nodes:
            if node.op != "call_module":
                continue
            callee = getattr(sub.get_submodule(node.target), "graph", None)
            if callee is None:
                continue
            wanted = sum(1 for n in callee.nodes if n.op == "placeholder")
            if len(node.args) + len(node.kwargs) < wanted:
                name = f"{owner}.{node.target}" if owner else node.target
                raise TracedSplitError(
                    f"torch's splitter dropped the inputs of {name} in traced stage {stage} "
                    f"({wanted} expected, {len(node.args) + len(node.kwargs)} passed; a torch "
                    "2.13 limitation with a submodule called on values its parent computes): "
                    "use frontend='module' (autopar's models) or another split")


class TracedSplitError(PlanError):
    """torch's splitter made stages that cannot run as torch's pipeline stages."""


class SkipConnectionError(TracedSplitError):
    """A traced stage reads a value made before the stage just before it."""


class _export_friendly:
    """Hugging Face models export without their KV cache (a cache object is not a tensor)."""

    def __init__(self, model: nn.Module) -> None:
        self.cfg = getattr(model, "config", None) if is_hf_model(model) else None

    def __enter__(self) -> None:
        if self.cfg is not None:
            self.old = getattr(self.cfg, "use_cache", None)
            self.cfg.use_cache = False

    def __exit__(self, *exc: object) -> None:
        if self.cfg is not None:
            self.cfg.use_cache = self.old


def _untie_local(mods: dict[int, nn.Module]) -> None:
    """Two local stages sharing one Parameter object would each scale and step it: give every
    stage its own copy (the runner sums the copies' gradients as for stages on two ranks)."""
    seen: set[int] = set()
    for _, mod in sorted(mods.items()):
        for name, p in list(mod.named_parameters(remove_duplicate=False)):
            if id(p) in seen:
                owner, _, attr = name.rpartition(".")
                sub = mod.get_submodule(owner) if owner else mod
                setattr(sub, attr, nn.Parameter(p.detach().clone(), p.requires_grad))
            seen.add(id(p))


# --- frontend "module": stage modules for autopar's model families ---------------------------


def module_family(model: nn.Module) -> str | None:
    """The family of stage modules built for ``model``: its own (``"gpt2"``, ``"llama3"``,
    ``"moe"``) where it implements the blocks protocol (:mod:`autopar.ir.blocks`, as
    autopar's models do), ``"hf"`` for the Hugging Face decoders :mod:`.hf_stages` builds
    stages for, else ``None``."""
    from autopar.runtime.pipeline.hf_stages import is_hf_decoder

    blocks = pipeline_blocks(model)
    if blocks is not None:
        return blocks.family
    return "hf" if is_hf_decoder(model) else None


class BlockStage(BlockCalls, nn.Module):
    """Blocks ``[a, b)`` of an autopar model, with the embedding on the first stage and the
    final norm and head on the last. Submodules keep the model's names (``layers.3`` is the
    model's ``layers[3]``), so parameter names are the model's.

    Inputs and outputs: tokens into the first stage; the hidden state between stages (and, for
    MoE, the balance loss summed so far, a 0-d fp32 tensor); logits out of the last (with the
    summed balance loss for MoE). Blocks are called through ``call_block``, which a plan's
    recomputation wraps (:mod:`.planned_stage`)."""

    def __init__(self, model: nn.Module, parts: PipelineBlocks, a: int, b: int,
                 first: bool, last: bool) -> None:
        super().__init__()
        self.parts, self.family = parts, parts.family
        self.block_path, self.first, self.last = parts.blocks, first, last
        self.cfg = model.config
        blocks = model.get_submodule(parts.blocks)
        holder = nn.ModuleDict({str(i): copy.deepcopy(blocks[i]) for i in range(a, b)})
        self.add_module(parts.blocks, holder)
        self.order = [str(i) for i in range(a, b)]
        if first or (last and parts.tied):
            self.add_module(parts.embedding,
                            copy.deepcopy(model.get_submodule(parts.embedding)))
        if first and parts.positions is not None:
            self.add_module(parts.positions, copy.deepcopy(model.get_submodule(parts.positions)))
        if last:
            self.add_module(parts.norm, copy.deepcopy(model.get_submodule(parts.norm)))
            if not parts.tied:
                self.add_module(parts.head, copy.deepcopy(model.get_submodule(parts.head)))
        if parts.rotary:  # RoPE tables: every stage its own (not sent between stages)
            self.register_buffer("rope_cos", model.rope_cos.detach().clone(), persistent=False)
            self.register_buffer("rope_sin", model.rope_sin.detach().clone(), persistent=False)

    def forward(self, *args: torch.Tensor) -> Any:
        moe = self.parts.balance_loss
        if self.first:
            (tokens,) = args
            x, aux = self._embed(tokens), None
            if moe:
                aux = x.new_zeros((), dtype=torch.float32)
        else:
            x, aux = (args[0], args[1]) if moe else (args[0], None)
        blocks = self.get_submodule(self.block_path)
        if not self.parts.rotary:
            for i in self.order:
                x = self.call_block(blocks[i], x)
        else:
            s = x.shape[1]
            cos, sin = self.rope_cos[:s], self.rope_sin[:s]
            for i in self.order:
                if moe:
                    x, a = self.call_block(blocks[i], x, cos, sin)
                    aux = aux + a
                else:
                    x = self.call_block(blocks[i], x, cos, sin)
        if self.last:
            x = self._head(x)
        return (x, aux) if moe else x

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.get_submodule(self.parts.embedding)(tokens)
        if self.parts.positions is None:
            return x
        x = x + self.get_submodule(self.parts.positions).weight[: tokens.shape[1]]
        dropout = getattr(self.cfg, "dropout", 0.0)
        return F.dropout(x, dropout, self.training) if dropout > 0 else x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        head = self.parts.embedding if self.parts.tied else self.parts.head
        return F.linear(self.get_submodule(self.parts.norm)(x),
                        self.get_submodule(head).weight)


def module_stages(model: nn.Module, block_path: str, ranges: Ranges,
                  local: Sequence[int]) -> dict[int, nn.Module]:
    """The local stages as :class:`BlockStage` modules (each with its own parameter copies)."""
    family = module_family(model)
    if family == "hf":
        from autopar.runtime.pipeline.hf_stages import hf_stages

        return hf_stages(model, ranges, local)
    if family is None:
        raise PlanError(
            f"frontend='module' knows autopar's GPT-2, Llama-3 and MoE models and Hugging Face "
            f"Llama-style decoders, not {type(model).__name__}: use frontend='trace' (torch's "
            "splitter)")
    parts = pipeline_blocks(model)
    assert parts is not None  # module_family found it
    last = len(ranges) - 1
    return {s: BlockStage(model, parts, *ranges[s], s == 0, s == last) for s in local}
