"""The blocks protocol (``autopar.ir.blocks``): autopar's models say where their pieces are,
and the pipeline runtime finds them through it alone."""

from __future__ import annotations

import pytest

from autopar.ir.blocks import HasPipelineBlocks, PipelineBlocks, pipeline_blocks
from autopar.models import get_preset
from autopar.runtime.pipeline import stages as ps


@pytest.mark.parametrize("preset, family, blocks, tied", [
    ("gpt2-tiny", "gpt2", "blocks", True), ("llama3-tiny", "llama3", "layers", False),
    ("moe-tiny", "moe", "layers", False)])
def test_autopars_models_implement_the_protocol(preset: str, family: str, blocks: str,
                                                tied: bool) -> None:
    model = get_preset(preset).build("meta")
    assert isinstance(model, HasPipelineBlocks)
    parts = pipeline_blocks(model)
    assert (parts.family, parts.blocks, parts.tied) == (family, blocks, tied)
    assert ps.module_family(model) == family
    path, found = ps.find_blocks(model)
    assert path == blocks and found is model.get_submodule(blocks)
    for name in (parts.embedding, parts.norm, parts.head, parts.positions):
        if name is not None:
            model.get_submodule(name)  # every piece it names is there


def test_a_model_without_it_is_not_autopars() -> None:
    from torch import nn

    plain = nn.Sequential(nn.Linear(2, 2))
    assert pipeline_blocks(plain) is None and ps.module_family(plain) is None
    with pytest.raises(ValueError, match="family 'rnn'"):
        PipelineBlocks("rnn", "layers", "embed", "norm")
