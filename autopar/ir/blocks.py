"""The blocks protocol: how a model tells a pipeline where its pieces are.

A pipeline cuts a model into stages over contiguous ranges of its repeated blocks, with the
embedding on the first stage and the final norm and head on the last. A model that knows its
own layout says so by implementing :class:`HasPipelineBlocks`, a ``pipeline_blocks()`` method
returning a :class:`PipelineBlocks`; the runtime builds its stage modules from that record
alone and never imports a model class (autopar's GPT-2, Llama-3 and MoE in ``models/`` do).
A model without it is taken apart generically where it can be (Hugging Face decoders,
``runtime/pipeline/hf_stages.py``; torch's splitter for the rest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

FAMILIES = ("gpt2", "llama3", "moe")  # the stage layouts the runtime's block stages know


@dataclass(frozen=True, slots=True)
class PipelineBlocks:
    """Where a model keeps the pieces of its forward, by submodule name.

    ``family``: how its blocks are called (:data:`FAMILIES`: ``"gpt2"`` blocks take the
    hidden state; ``"llama3"`` blocks also the rotary tables; ``"moe"`` blocks return a
    balance loss beside it, summed over the layers). ``blocks``: the ``nn.ModuleList`` of
    repeated blocks; ``embedding``: the token embedding; ``positions``: a learned position
    embedding added to it (GPT-2's); ``norm``: the final norm; ``head``: the output
    projection, None where the head is the embedding's weight (tied); ``rotary``: the model
    holds ``rope_cos`` / ``rope_sin`` buffers its blocks read."""

    family: str
    blocks: str
    embedding: str
    norm: str
    head: str | None = None
    positions: str | None = None
    rotary: bool = False

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"pipeline block family {self.family!r}: use one of "
                             f"{', '.join(FAMILIES)}")

    @property
    def tied(self) -> bool:
        """The head is the embedding's weight: the last stage holds a copy of it."""
        return self.head is None

    @property
    def balance_loss(self) -> bool:
        """The blocks return ``(x, balance loss)`` (mixture of experts)."""
        return self.family == "moe"


@runtime_checkable
class HasPipelineBlocks(Protocol):
    def pipeline_blocks(self) -> PipelineBlocks: ...


def pipeline_blocks(model: Any) -> PipelineBlocks | None:
    """The model's own :class:`PipelineBlocks`, or None where it does not implement
    :class:`HasPipelineBlocks`."""
    if isinstance(model, HasPipelineBlocks):
        found = model.pipeline_blocks()
        if isinstance(found, PipelineBlocks):
            return found
    return None
