"""Every private torch API autopar uses, called once: a torch release that changes one fails here."""

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import _torch_compat as compat


def test_fake_mode_makes_fake_tensors_without_storage():
    mode = compat.new_fake_mode()
    with mode:
        t = torch.empty(1 << 20, 1 << 20)  # 4 TiB if it were real
    assert compat.is_fake(t)


def test_annotations_reach_traced_nodes():
    def f(x):
        with compat.annotate({"autopar_layer": 3}):
            y = x * 2
        return y + 1

    with compat.preserve_node_meta():
        gm = make_fx(f)(torch.randn(2))
    tagged = [n for n in gm.graph.nodes if (n.meta.get("custom") or {}).get("autopar_layer") == 3]
    untagged = [n for n in gm.graph.nodes if n.op == "call_function" and n not in tagged]
    assert len(tagged) == 1 and len(untagged) == 1


def test_flop_registry_counts_matmuls():
    reg = compat.flop_registry()
    assert torch.ops.aten.mm.default in reg or torch.ops.aten.mm in reg


def test_local_tensor_mode_exists():
    assert compat.local_tensor_mode() is not None


def test_version_is_supported():
    assert (2, 11) <= compat.TORCH_VERSION < (3, 0)
    assert isinstance(fx.Graph(), fx.Graph)


def test_a_trace_that_fails_inside_a_repeated_block_leaks_no_layer_tag():
    import torch.fx.traceback as fxt
    import torch.nn as nn

    from autopar.capture import capture
    from autopar.errors import CaptureError

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            return x[x > 0].sum() * self.w.sum() + x * self.w  # data-dependent: fails

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block(), Block()])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x.sum()

    before = dict(fxt.current_meta)
    try:
        capture(Model(), (torch.randn(4),))
    except CaptureError:
        pass
    import gc

    gc.collect()  # a tag left open would be closed here and restore a stale annotation
    assert dict(fxt.current_meta) == before
