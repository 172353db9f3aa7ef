"""The runtime keeps every tensor of a step on the mesh's device, not on the CPU.

NCCL runs on CUDA tensors; gloo on CPU ones. No GPU is at hand in CI, so these tests run the
whole step (forward, backward with its gradient syncs and parameter gathers, optimizer step)
on a mesh of the ``meta`` device over a fake process group of 4 or 8 ranks: rank 0's program,
every tensor on ``meta``, collectives issued and answered by the fake group without data.
A CPU tensor created by the runtime (a buffer, a padding block, an index) would sit where a
CUDA run has a CPU tensor among CUDA ones: most ops refuse that (``Tensor on device cpu is not
on the expected device meta``) and a recording dispatch mode catches the rest. The model and
its inputs are given on the CPU, as a user holding a CPU model would give them: parallelize
moves them to the mesh's device. A mesh of another device type than ``cpu`` is planned with a
GPU profile (``Mesh.from_device_mesh``), so this also runs the GPU's gradient buckets.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from harness.spmd import fake_group, mesh_for, reference_plan
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import autopar
from autopar.models import get_preset

# ops that take a CPU tensor on purpose: the user's CPU input (or a CPU model's weight) moved
# to the mesh's device
_MOVES = {torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default}


@contextlib.contextmanager
def _meta_mesh(shape: tuple[int, ...], axes: tuple[str, ...]) -> Iterator[Any]:
    from torch.distributed.device_mesh import DeviceMesh

    size = math.prod(shape)
    with fake_group(size):
        yield DeviceMesh("meta", torch.arange(size).view(shape), mesh_dim_names=axes)


class _CpuOps(TorchDispatchMode):
    """Records every op that reads or makes a CPU tensor of more than one element (a CPU
    0-dim scalar mixes with CUDA tensors legitimately), other than a move to the device."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func not in _MOVES:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
            if any(t.device.type == "cpu" and t.dim() > 0 for t in tensors):
                self.seen.append(str(func))
        return out


def _preset(preset_name: str) -> tuple[Any, torch.nn.Module, tuple]:
    preset_name, _, extra = preset_name.partition("+")
    preset = get_preset(preset_name)
    if extra == "dropout":  # random ops: drawn whole on each rank, on the mesh's device
        preset = preset.replace(dropout=0.1)
    if preset.family == "gpt2":
        preset = preset.replace(n_positions=16)
    torch.manual_seed(0)
    model = preset.build(device="cpu")
    inputs = preset.example_inputs(8, 8, device="cpu")
    return preset, model, inputs


def _hf(kind: str) -> tuple[torch.nn.Module, dict]:
    """A Hugging Face causal LM from a small config; its keyword inputs."""
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2,
                                      n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    elif kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**small))
    else:
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2))
    ids = torch.randint(0, 64, (4, 8))
    return model.train(), {"input_ids": ids, "labels": ids}


def _steps_on_meta(pm: torch.nn.Module, call: Any, optimizer: dict) -> list[str]:
    """Two training steps of ``call()``; the ops that touched a CPU tensor on the way."""
    opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, **optimizer)
    with _CpuOps() as rec:
        for _ in range(2):
            loss = call()
            loss.backward()
            opt.step()
            opt.zero_grad()
    assert loss.device.type == "meta"
    for name, p in pm.named_parameters():
        assert isinstance(p, DTensor) and p.to_local().device.type == "meta", name
        for key, state in opt.state[p].items():
            if isinstance(state, torch.Tensor) and state.dim() > 0:
                local = state.to_local() if isinstance(state, DTensor) else state
                assert local.device.type == "meta", f"{name} optimizer state {key}"
    return rec.seen


CASES = [  # (preset, mesh shape, plan source)
    ("mlp-tiny", (4,), "solver"),
    ("gpt2-tiny", (4,), "data_parallel"),
    ("gpt2-tiny", (4,), "fsdp"),
    ("gpt2-tiny", (4,), "megatron_tp"),
    ("gpt2-tiny", (2, 2), "solver"),
    ("gpt2-tiny", (2, 2), "fsdp_tp_2d"),
    ("gpt2-tiny+dropout", (2, 2), "solver"),
    ("llama3-tiny", (2, 2), "dp_tp_2d"),
    ("moe-tiny", (2, 2), "solver"),
    ("mlp-tiny", (2, 2, 2), "solver"),
]


@pytest.mark.parametrize("preset_name,shape,source", CASES,
                         ids=[f"{p}-{'x'.join(map(str, s))}-{src}" for p, s, src in CASES])
def test_a_step_keeps_every_tensor_on_the_mesh_device(preset_name: str, shape: tuple,
                                                       source: str) -> None:
    preset, model, inputs = _preset(preset_name)
    axes = mesh_for(shape).axes
    plan = None
    if source != "solver":
        plan = reference_plan(model, preset.family, source, autopar.Mesh(shape, axes, "h100"),
                              inputs)
        assert plan is not None, f"{source} does not apply to {preset_name} on {shape}"
    with _meta_mesh(shape, axes) as mesh:
        pm = autopar.parallelize(model, mesh, example_inputs=inputs, plan=plan,
                                 time_limit_s=2.0)
        seen = _steps_on_meta(pm, lambda: pm(*inputs), {"foreach": False})
    assert not seen, f"ops on CPU tensors during the step: {sorted(set(seen))}"


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_hugging_face_models_keep_every_tensor_on_the_mesh_device(kind: str) -> None:
    """Their graphs hold device arguments (masks, positions, ``.to(device)``), all traced on
    the CPU."""
    model, kw = _hf(kind)
    with _meta_mesh((2, 2), ("dp", "tp")) as mesh:
        pm = autopar.parallelize(model, mesh, example_kwargs=kw, time_limit_s=2.0)
        seen = _steps_on_meta(pm, lambda: pm(**kw), {"foreach": False})
    assert not seen, f"ops on CPU tensors during the step: {sorted(set(seen))}"


def test_foreach_optimizer_and_gradient_accumulation_stay_on_the_mesh_device() -> None:
    """The foreach optimizer, and a second backward adding into existing gradients."""
    _, model, inputs = _preset("gpt2-tiny")
    with _meta_mesh((2, 2), ("dp", "tp")) as mesh:
        # fp32, where the solver replicates the parameters: on sharded ones DTensor's foreach
        # rule prices redistributions, which asks the device for its count, and meta has none
        pm = autopar.parallelize(model, mesh, example_inputs=inputs, time_limit_s=5.0,
                                 precision="fp32")
        opt = torch.optim.AdamW(pm.parameters(), lr=1e-3, foreach=True)
        with _CpuOps() as rec:
            for _ in range(2):
                pm(*inputs).backward()
            opt.step()
        assert all(p.grad.to_local().device.type == "meta" for p in pm.parameters())
    assert not rec.seen, f"ops on CPU tensors: {sorted(set(rec.seen))}"


def test_the_recorder_catches_a_cpu_tensor() -> None:
    """The check has teeth: an op mixing in a CPU tensor the meta device does not refuse."""
    a, b = torch.ones(2, 3, device="meta"), torch.ones(3, 2)
    with _CpuOps() as rec:
        torch.mm(a, b)
        a + torch.tensor(1.0)  # a CPU scalar: allowed, as with CUDA
    assert rec.seen == ["aten.mm.default"]
