"""Every private torch API autopar uses, called once: a torch release that changes one fails here."""

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from autopar.capture import _torch_compat as compat


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
