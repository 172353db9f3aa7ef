"""The one place autopar touches private or not-backward-compatible torch APIs.

Each function wraps one such API; ``tests/test_torch_compat.py`` calls every one of them so a
torch release that changes them fails loudly there instead of deep inside planning.
Supported torch: 2.11 to 2.13.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def new_fake_mode():
    """A FakeTensorMode that accepts no real tensors (everything is converted first)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=False)


def is_fake(t: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def preserve_node_meta():
    """Make ``make_fx`` copy the current tracing meta (``custom`` annotations) onto nodes."""
    import torch.fx.traceback as fxt

    return fxt.preserve_node_meta()


@contextlib.contextmanager
def annotate(tags: dict[str, Any]) -> Iterator[None]:
    """Tag every node traced inside the block with ``node.meta["custom"][k] = v``."""
    import torch.fx.traceback as fxt

    with fxt.annotate(tags):
        yield


@contextlib.contextmanager
def annotation_scope() -> Iterator[None]:
    """Whatever happens inside (a trace that raises halfway through a tagged block), the
    tracing annotations are as they were on entry: no tag leaks into the next trace."""
    import torch.fx.traceback as fxt

    had = "custom" in fxt.current_meta
    saved = dict(fxt.current_meta["custom"]) if had else None
    try:
        yield
    finally:
        if had:
            fxt.current_meta["custom"] = saved
        else:
            fxt.current_meta.pop("custom", None)


def flop_registry() -> dict:
    """torch's per-op FLOP formulas (``torch.utils.flop_counter``), keyed by op packet."""
    from torch.utils.flop_counter import flop_registry as reg

    return reg


def local_tensor_mode():
    """Single-process simulation of all ranks (``LocalTensorMode``), used by SPMD tests."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode


TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
