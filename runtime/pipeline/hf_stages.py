"""Pipeline stage modules for Hugging Face decoder-only causal LMs (Llama, Qwen2/3, Mistral).

torch 2.13's splitter cannot cut these models: their decoder computes the rotary position
embeddings once (``model.rotary_emb``, called on position ids the decoder makes) and hands
them to every layer, and the split drops the rotary module's inputs
(:func:`autopar.runtime.pipeline.stages._check_calls` refuses it). So each stage here rebuilds
what the decoder's own forward gives its layers, from the sequence length alone: the position
ids ``0..s-1``, the cos/sin tables from its own copy of ``rotary_emb`` (a few buffers, no
parameters) and the causal mask from the model's own mask function. Between stages only the
hidden state travels.

A stage is blocks ``[a, b)`` of ``model.layers`` with ``model.embed_tokens`` on the first and
``model.norm`` and ``lm_head`` on the last; submodules keep the model's names
(``model.layers.3.self_attn.q_proj.weight``) so stage state maps back to the model. The loss
(next-token cross-entropy) is the schedule's, from the last stage's logits
(:func:`autopar.runtime.pipeline.stages.loss_fn_for`).

Only architectures whose decoder forward is exactly "embed, layers with (mask, positions,
rotary tables), norm" are taken (:data:`ARCHITECTURES`); a model that scales its embeddings
(Gemma), uses sliding-window layers or routes experts with an auxiliary loss would be computed
differently here, so it is refused, not approximated.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from autopar.ir.errors import PlanError
from autopar.runtime.pipeline.planned_stage import BlockCalls

# config.model_type of decoders whose forward the stages below reproduce
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def is_hf_decoder(model: nn.Module) -> bool:
    """A Hugging Face causal LM this module's stages reproduce: its ``model_type`` is one of
    :data:`ARCHITECTURES`, with the decoder under ``model`` and the head as ``lm_head``, and no
    sliding-window attention."""
    cfg = getattr(model, "config", None)
    if cfg is None or getattr(cfg, "model_type", None) not in ARCHITECTURES:
        return False
    base = getattr(model, "model", None)
    parts = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, p) for p in parts) or not hasattr(model, "lm_head"):
        return False
    return not _sliding(cfg)


def _sliding(cfg: Any) -> bool:
    """Whether some layers attend within a sliding window (their mask is not the causal one)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return any(t != "full_attention" for t in types)
    if getattr(cfg, "use_sliding_window", None) is False:  # Qwen2's switch
        return False
    return getattr(cfg, "sliding_window", None) is not None


class HFDecoderStage(BlockCalls, nn.Module):
    """Blocks ``[a, b)`` of a Hugging Face decoder as one pipeline stage. Token ids in on the
    first stage, the hidden state between stages, logits out of the last."""

    def __init__(self, model: nn.Module, a: int, b: int, first: bool, last: bool) -> None:
        super().__init__()
        self.first, self.last = first, last
        base = model.model
        self.config = model.config
        holder = nn.Module()  # named "model", as in the whole model
        if first:
            holder.embed_tokens = copy.deepcopy(base.embed_tokens)
        holder.layers = nn.ModuleDict({str(i): copy.deepcopy(base.layers[i]) for i in range(a, b)})
        holder.rotary_emb = copy.deepcopy(base.rotary_emb)  # every stage its own tables
        if last:
            holder.norm = copy.deepcopy(base.norm)
        self.model = holder
        if last:  # a head tied to the embedding becomes a copy; the runner sums the gradients
            self.lm_head = copy.deepcopy(model.lm_head)
        self.order = [str(i) for i in range(a, b)]
        self._mask_fn = _mask_function(model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.first else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        rope = self.model.rotary_emb(h, positions)
        mask = self._mask_fn(self.config, h, positions)
        for i in self.order:
            out = self.call_block(self.model.layers[i], h, attention_mask=mask,
                                  position_ids=positions, position_embeddings=rope)
            h = out[0] if isinstance(out, tuple) else out  # transformers < 4.54: a tuple
        if self.last:
            h = self.lm_head(self.model.norm(h))
        return h


def hf_stages(model: nn.Module, ranges: Sequence[tuple[int, int]], local: Sequence[int]
              ) -> dict[int, nn.Module]:
    """The local stages as :class:`HFDecoderStage` modules (each with its own parameters)."""
    if not is_hf_decoder(model):
        raise PlanError(
            f"autopar's pipeline stages for Hugging Face models take decoders of types "
            f"{', '.join(ARCHITECTURES)} without sliding-window attention, not "
            f"{type(model).__name__}: use frontend='trace' (torch's splitter) or run the model "
            "without a pp axis")
    last = len(ranges) - 1
    return {s: HFDecoderStage(model, *ranges[s], s == 0, s == last) for s in local}


def _mask_function(model: nn.Module) -> Any:
    """``f(config, hidden, position_ids)``: the causal mask the model's decoder would give its
    layers for a batch without padding, made by the model's own function (None where the
    attention implementation is causal by itself, as SDPA's is). The function and its
    arguments changed across transformers releases: ``create_causal_mask`` (4.53 on; its
    keywords renamed since) or the decoder's ``_update_causal_mask`` before."""
    module = sys.modules[type(model.model).__module__]
    create = getattr(module, "create_causal_mask", None)
    if create is not None:
        wanted = inspect.signature(create).parameters

        def made(cfg: Any, h: torch.Tensor, positions: torch.Tensor) -> Any:
            given = {"config": cfg, "inputs_embeds": h, "input_embeds": h,
                     "attention_mask": None, "cache": None, "past_key_values": None,
                     "cache_position": positions[0], "position_ids": positions}
            return create(**{k: v for k, v in given.items() if k in wanted})
        return made
    update = getattr(model.model, "_update_causal_mask", None)
    if update is not None:
        def updated(cfg: Any, h: torch.Tensor, positions: torch.Tensor) -> Any:
            return update(None, h, positions[0], None, False)
        return updated
    raise PlanError(
        f"this transformers release makes {type(model).__name__}'s causal mask in a way autopar's "
        "pipeline stages do not know: use transformers 4.45 or later, or run without a pp axis")
