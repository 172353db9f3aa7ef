"""Non-tensor inputs (bools, ints, floats, strings, None, at any depth of lists and dicts) are
constants of the traced program: the parallel model equals one device, and a call with other
values is refused naming the input (simulated mesh)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from harness.spmd import assert_same_training, fake_world, mesh_for, run_case

import autopar
from autopar.ir.errors import PlanError
from autopar.ir.inputs import constants_mismatch, split_inputs


class Knobs(nn.Module):
    """A model whose behaviour the non-tensor inputs choose."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x, y, opts, *, scale, act, skip=None, extra=None, dtype=torch.float32):
        h = self.inp(x) * scale
        for _ in range(opts["repeat"]):
            h = self.hidden(h)
            h = F.gelu(h) if act == "gelu" else torch.relu(h)
        if opts["residual"]:
            h = h + self.inp(x)
        if skip is not None:
            h = h * skip
        shift, weight, note = extra["shift"]
        assert note is None and isinstance(weight, float)
        out = self.out(h).to(dtype) + shift * weight
        return F.mse_loss(out, y) * (2.0 if opts["flags"][1] else 1.0)


def _inputs() -> tuple[tuple, dict]:
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    args = (x, y, {"repeat": 2, "residual": True, "flags": [False, True]})
    kwargs = {"scale": 0.5, "act": "gelu", "skip": None, "dtype": torch.float32,
              "extra": {"shift": [torch.randn(4), 0.25, None]}}
    return args, kwargs


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_constants_of_every_kind_equal_one_device(mesh_shape) -> None:
    args, kwargs = _inputs()
    torch.manual_seed(1)
    got, want, _ = run_case(Knobs(), args, mesh_shape, kwargs=kwargs, steps=2, time_limit_s=2.0)
    assert_same_training(got, want, 1e-5, f"mesh {mesh_shape}")


def test_other_constant_values_are_refused_naming_the_input() -> None:
    args, kwargs = _inputs()
    mesh, model = mesh_for((2,)), Knobs()
    with fake_world(mesh.size):
        pm = autopar.parallelize(model, mesh, args, kwargs, time_limit_s=2.0)
        pm(*args, **kwargs)  # the traced values run
        with pytest.raises(PlanError, match=r"act is 'relu', traced with 'gelu'.*parallelize"):
            pm(*args, **{**kwargs, "act": "relu"})
        opts = {**args[2], "flags": [False, False]}
        with pytest.raises(PlanError, match=r"arg2\['flags'\]\[1\] is False, traced with True"):
            pm(args[0], args[1], opts, **kwargs)


def test_split_inputs_puts_tensors_back_in_their_places() -> None:
    args, kwargs = _inputs()
    tensors, call = split_inputs(args, kwargs)
    assert [t is u for t, u in zip(tensors, [args[0], args[1], kwargs["extra"]["shift"][0]])] \
        == [True] * 3
    args2, kwargs2 = call.rebuild(tensors)
    assert args2[2] == args[2] and kwargs2["act"] == "gelu" and kwargs2["skip"] is None
    assert kwargs2["extra"]["shift"][0] is tensors[2] and kwargs2["extra"]["shift"][1:] == [0.25, None]
    # a fresh object of the same type is the same constant; a plain value is compared by value
    _, again = split_inputs(args, {**kwargs, "extra": {"shift": [tensors[2], 0.25, None]}})
    assert constants_mismatch(call, again) is None
    _, other = split_inputs(args, {**kwargs, "scale": 1})
    assert constants_mismatch(call, other) == "scale is 1, traced with 0.5"


def test_clip_with_return_loss_equals_one_device() -> None:
    """Hugging Face CLIP, called as its docs do: ``model(..., return_loss=True)``."""
    transformers = pytest.importorskip("transformers")
    text = transformers.CLIPTextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, max_position_embeddings=16, bos_token_id=0, eos_token_id=63,
        pad_token_id=1)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=1, num_attention_heads=4,
                                           image_size=16, patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                  projection_dim=16)
    torch.manual_seed(0)
    model = transformers.CLIPModel(cfg)
    ids = torch.randint(2, 63, (4, 8))
    ids[:, -1] = 63  # the end-of-text token, which the text tower pools
    kwargs = {"input_ids": ids, "pixel_values": torch.randn(4, 3, 16, 16), "return_loss": True}
    got, want, _ = run_case(model, (), (2,), kwargs=kwargs, steps=2, time_limit_s=2.0)
    assert [g.item() for g in got["losses"]] == pytest.approx(
        [w.item() for w in want["losses"]], rel=1e-5)
    for name, w in want["params"].items():
        if name.endswith("k_proj.bias"):  # zero in exact arithmetic (softmax ignores a shift):
            continue  # its gradient, and so its value, is rounding noise on either side
        assert (got["params"][name] - w).norm() <= 1e-5 * w.norm(), name
