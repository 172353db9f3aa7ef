"""Planning a deep model on a shallow proxy of itself.

A 126-layer model repeats one block 126 times. The planner shares one set of solver variables
between identical layers anyway, so tracing all of them only costs time. With ``max_layers=k``
capture keeps the first ``k`` blocks (the first and last stay themselves: they meet the
embedding and the head), and every middle block stands for ``(L - 2) / (k - 2)`` real ones:
its compute, communication and memory are weighted by that factor. Parameters of the blocks
that were not traced take the placements of the traced block they stand for.

Step time and collectives come out exactly as from the full trace. Peak memory errs a little
high: a middle block's short-lived temporaries are weighted like its saved activations.

A pipeline stage is planned the same way (:func:`stage_representative`): the traced blocks
stand for the blocks one stage holds (``stands_for``), and every activation kept for the
backward is held ``in_flight`` times, once per microbatch the schedule keeps in flight on a
rank, so the plan's peak memory is a stage's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

from autopar.ir.depth import DepthProxy


def longest_block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(c) for c in mod}) == 1:
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    return best


@contextlib.contextmanager
def truncated(model: nn.Module, max_layers: int | None) -> Iterator[DepthProxy | None]:
    """Within the block, the model's longest list of repeated blocks keeps ``max_layers``."""
    found = longest_block_list(model) if max_layers else None
    if found is None or max_layers is None or len(found[1]) <= max_layers:
        yield None
        return
    if max_layers < 3:
        raise ValueError("a depth proxy needs at least 3 layers: first, middle and last")
    path, blocks = found
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    parent._modules[attr] = nn.ModuleList(list(blocks)[:max_layers])
    try:
        yield DepthProxy(path, len(blocks), max_layers)
    finally:
        parent._modules[attr] = blocks


def traced_blocks(blocks: int, max_layers: int | None) -> int:
    """How many blocks a stage of ``blocks`` is traced with: all of them up to
    ``max_layers``, at least 3 for a proxy, and at least 2, since capture tags a list's
    blocks only where it holds two or more."""
    kept = blocks if not max_layers or blocks <= max_layers else max(3, max_layers)
    return max(kept, 2)


@contextlib.contextmanager
def stage_representative(model: nn.Module, blocks: int, max_layers: int | None,
                         in_flight: float) -> Iterator[DepthProxy]:
    """Within the block, the model traces as one pipeline stage of ``blocks`` of its repeated
    blocks (at most ``max_layers`` traced, the middle ones weighted), each activation kept
    for the backward held ``in_flight`` times. The embedding and the head stay: the first
    and last stages hold them, and one layout serves every stage."""
    found = longest_block_list(model)
    if found is None:
        raise ValueError("the model has no list of repeated blocks to cut into stages")
    path, block_list = found
    blocks = max(1, min(blocks, len(block_list)))
    kept = traced_blocks(blocks, max_layers)
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    parent._modules[attr] = nn.ModuleList(list(block_list)[:kept])
    try:
        yield DepthProxy(path, len(block_list), kept, blocks, float(in_flight))
    finally:
        parent._modules[attr] = block_list
