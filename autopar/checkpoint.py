"""Checkpoint and resume a training run, on any mesh, on ``torch.distributed.checkpoint``.

::

    save(directory, model, optimizer=None, *, step: int, lr_scheduler=None,
         data_state: dict | None = None, blocking: bool = True) -> SaveHandle
    load(directory, model, optimizer=None, *, lr_scheduler=None,
         step: int | None = None) -> Resumed          # Resumed(step, data_state, path)
    latest_step(directory) -> int | None

``save`` writes, together, the model's state, the optimizer's state, the learning-rate
scheduler's, the step, the data position (``data_state``: whatever the loop needs to go on,
e.g. ``{"epoch": 1, "offset": 4096}``) and the random state of every rank (torch's CPU and
CUDA generators, Python's ``random``, NumPy's). Every rank calls it (it is collective where a
process group is up). ``blocking=False`` returns once the state is copied off the device into
host memory; a background thread writes it, and :meth:`SaveHandle.wait` returns once it is
committed (the next ``save`` or ``load`` waits for it first).

A checkpoint is committed atomically: every rank writes into ``DIR/step-<step:09d>.tmp/``;
once all have finished, rank 0 renames it ``DIR/step-<step:09d>/`` and then replaces
``DIR/latest`` (written aside, then ``os.replace``d). A save that dies half-way leaves only a
``.tmp`` directory, which is never loaded, and ``latest`` naming the last committed step.

Everything is keyed by the single-device model's names (``ParallelModule`` and
``PipelineModule`` state dicts use them; the optimizer's state is keyed
``optim.state.<parameter name>.<state key>``), and a parameter's state is saved as its pieces
with their place in the whole tensor. So ``load`` reshards: a checkpoint saved under one plan
and mesh loads under any other (dp x tp into pp x dp, 4 processes into 8, FSDP into tensor
parallel), and into the plain single-device model without a process group (whole tensors).

``load`` checks the checkpoint against the model before it reads a tensor (missing or
unexpected keys, shapes that differ) and reads into fresh tensors, copied into the model and
the optimizer only once everything was read: a failed load (:class:`CheckpointError`, one line
naming the cause and the fix) leaves both as they were. Random state: each rank restores its
own where the number of processes is the one saved; on another number every rank takes rank
0's (an SPMD program keeps every rank's generators alike; re-seed anything that depends on
the rank from ``data_state``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import shutil
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from autopar.ir.errors import CheckpointError, first_line

__all__ = ["CheckpointError", "Resumed", "SaveHandle", "latest_step", "load", "save"]

LATEST = "latest"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
MODEL, OPTIM_STATE, OPTIM_GROUP, OPTIM_TIED = "model.", "optim.state.", "optim.group.", "optim.tied"
META, SCHEDULER, RNG = "meta", "lr_scheduler", "rng.rank"
FORMAT = 1  # what ``meta`` says this module wrote


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step-{step:09d}"


@dataclass(frozen=True)
class Resumed:
    """What :func:`load` restored: the step the checkpoint was saved at, the data position
    saved with it, and its directory."""

    step: int
    data_state: dict | None
    path: Path


class SaveHandle:
    """A save under way. :meth:`wait` returns once it is committed (raising what failed);
    :meth:`done` says whether it has finished."""

    def __init__(self, path: Path, thread: threading.Thread | None = None) -> None:
        self.path = path
        self._thread = thread
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return self.path


_in_flight: SaveHandle | None = None


def _wait_in_flight() -> None:
    global _in_flight
    handle, _in_flight = _in_flight, None
    if handle is not None:
        handle.wait()


# --- where the checkpoints are -----------------------------------------------------------------


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """The steps committed in ``directory`` (their ``.metadata`` written), oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    steps = []
    for entry in d.iterdir():
        m = _STEP_DIR.match(entry.name)
        if m and (entry / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step ``DIR/latest`` names, or, where it is missing or unreadable, the newest
    committed step; None where nothing was committed."""
    d = Path(directory)
    try:
        m = _STEP_DIR.match((d / LATEST).read_text().strip())
    except OSError:
        m = None
    if m and (d / m.group(0) / ".metadata").is_file():
        return int(m.group(1))
    steps = committed_steps(d)
    return steps[-1] if steps else None


# --- saving --------------------------------------------------------------------------------------


def save(directory: str | os.PathLike, model: nn.Module, optimizer: Any = None, *, step: int,
         lr_scheduler: Any = None, data_state: dict | None = None, blocking: bool = True
         ) -> SaveHandle:
    """Save the run at ``step`` into ``directory/step-<step:09d>/``, committed atomically.
    Every rank calls it. ``blocking=False``: return once the state is copied to host memory,
    writing in a background thread; the returned handle's ``wait()`` returns once committed.

    Example::

        handle = autopar.checkpoint.save("ckpt", model, opt, step=step, lr_scheduler=sched,
                                         data_state={"offset": offset}, blocking=False)
    """
    global _in_flight
    if not isinstance(step, int) or step < 0:
        raise CheckpointError(f"step={step!r}: give the training step as an int >= 0")
    _wait_in_flight()
    state = _run_state(model, optimizer, step=step, lr_scheduler=lr_scheduler,
                       data_state=data_state)
    final = step_dir(directory, step)
    group = _checkpoint_group()
    _prepare(final, group)
    if blocking:
        _write_and_commit(state, final, group)
        return SaveHandle(final)
    state = _staging.stage(state)  # the copy off the device, the only part the loop waits for
    handle = SaveHandle(final)

    def run() -> None:
        try:
            _write_and_commit(state, final, group)
        except BaseException as e:  # handed to wait()
            handle._error = e

    handle._thread = threading.Thread(target=run, name=f"autopar-save-{step}", daemon=False)
    handle._thread.start()
    _in_flight = handle
    return handle


def _run_state(model: nn.Module, optimizer: Any, *, step: int, lr_scheduler: Any,
               data_state: dict | None) -> dict[str, Any]:
    """Everything saved, flat: tensors (DTensors where sharded) and pickled blobs (so that
    DCP keeps them whole rather than flattening their dicts)."""
    state: dict[str, Any] = {MODEL + k: v for k, v in model_state(model).items()}
    if optimizer is not None:
        # a tied weight's state is saved once, under its first name: its other names
        state[OPTIM_TIED] = _blob({alias: all_names[0] for all_names in
                                   _all_param_names(model).values() for alias in all_names[1:]})
        state.update(_optimizer_entries(optimizer, model))
    if lr_scheduler is not None:
        state[SCHEDULER] = _blob(lr_scheduler.state_dict())
    state[META] = _blob({"format": FORMAT, "step": step, "data_state": data_state,
                         "world_size": _world_size()})
    state[f"{RNG}{_rank()}"] = _blob(_rng_state())
    return state


class _Staging:
    """Host copies of the state an asynchronous save writes. The buffers of host-resident
    tensors are kept from one save to the next where the state's layout is the same: copying
    into them costs a fraction of allocating anew (page faults). A device tensor is copied to
    the host by torch (a DTensor keeps its mesh and placements)."""

    def __init__(self) -> None:
        self.layout: tuple = ()
        self.buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed.tensor import DTensor

        layout = tuple((k, type(v), tuple(v.shape), v.dtype, v.device) if isinstance(
            v, torch.Tensor) else (k,) for k, v in state.items())
        if layout != self.layout:
            self.layout, self.buffers = layout, {}
        out: dict[str, Any] = {}
        with torch.no_grad():
            for key, value in state.items():
                if not isinstance(value, torch.Tensor):
                    out[key] = value
                    continue
                piece = value.to_local() if isinstance(value, DTensor) else value
                if piece.device.type != "cpu":
                    out[key] = value.detach().to("cpu")
                    continue
                buf = self.buffers.get(key)
                if buf is None:
                    buf = self.buffers[key] = torch.empty_like(piece.detach())
                buf.copy_(piece.detach())
                out[key] = buf if not isinstance(value, DTensor) else DTensor.from_local(
                    buf, value.device_mesh, value.placements, run_check=False,
                    shape=value.shape, stride=value.stride())
        return out


_staging = _Staging()


def _prepare(final: Path, group: Any) -> None:
    """Rank 0 clears a half-written ``.tmp`` of this step; the others wait for it."""
    tmp = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    _barrier(group)


def _write_and_commit(state: dict, final: Path, group: Any) -> None:
    tmp = final.with_name(final.name + ".tmp")
    with _quiet():
        dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=group is None)
    # dcp.save returns on rank 0 once every rank's files are written and the metadata is
    failed = None
    if _rank() == 0:
        try:
            _commit(tmp, final)
        except OSError as e:
            failed = f"{type(e).__name__}: {e}"
    if group is not None:  # every rank learns whether it was committed
        said = [failed]
        dist.broadcast_object_list(said, src=dist.get_global_rank(group, 0), group=group)
        failed = said[0]
    if failed is not None:
        raise CheckpointError(
            f"{tmp} was written but could not be committed as {final.name} ({failed}): the "
            "last committed checkpoint is unchanged; free the directory (space, permissions) "
            "and save again")


def _commit(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():  # the same step saved again: the new one replaces it
        old = final.with_name(final.name + f".old-{os.getpid()}")
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        if old is not None:  # put the committed one back
            os.replace(old, final)
        raise
    pointer = final.parent / f"{LATEST}.tmp-{os.getpid()}"
    with open(pointer, "w") as f:
        f.write(final.name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(pointer, final.parent / LATEST)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- loading -------------------------------------------------------------------------------------


def load(directory: str | os.PathLike, model: nn.Module, optimizer: Any = None, *,
         lr_scheduler: Any = None, step: int | None = None) -> Resumed:
    """Restore the run saved in ``directory`` (its ``latest`` step, or ``step``) into
    ``model``, ``optimizer`` and ``lr_scheduler``, resharded to their current placement, and
    this rank's random state. Every rank calls it. Returns the step and data position saved.

    Example::

        if autopar.checkpoint.latest_step("ckpt") is not None:
            resumed = autopar.checkpoint.load("ckpt", model, opt, lr_scheduler=sched)
            start = resumed.step + 1
    """
    _wait_in_flight()
    path = _resolve(Path(directory), step)
    metadata = _read_metadata(path)
    saved = metadata.state_dict_metadata
    target = model_state(model)
    aliases = _aliases(model.state_dict(keep_vars=True))  # keep_vars: a tied tensor is one object
    _check_model(path, saved, target, aliases, getattr(model, "model_keys", None))
    request: dict[str, Any] = {}
    for key, value in target.items():
        if MODEL + key in saved:
            request[MODEL + key] = _fresh_like(value)
    tied: dict[str, str] = {}
    if optimizer is not None and OPTIM_TIED in saved:  # needed to know what to read next
        first = {OPTIM_TIED: None}
        _read(first, path)
        tied = _unblob(first[OPTIM_TIED])
    opt_request, slots = (_optimizer_request(optimizer, model, saved, tied)
                          if optimizer is not None else ({}, []))
    request.update(opt_request)
    # each rank its own random state where the number of processes is the one saved, else
    # rank 0's (an SPMD program keeps every rank's generators alike)
    saved_world = sum(1 for k in saved if k.startswith(RNG))
    rng_key = f"{RNG}{_rank() if saved_world == _world_size() else 0}"
    for key in [META, *([SCHEDULER] if lr_scheduler is not None else []), rng_key]:
        if key not in saved:
            if key == SCHEDULER:
                raise CheckpointError(
                    f"{path} holds no learning-rate scheduler state (it was saved without "
                    "lr_scheduler=): load it without lr_scheduler=, or save one with it")
            raise CheckpointError(f"{path} has no '{key}' entry: it was not written by "
                                  "autopar.checkpoint.save; save the run with it")
        request[key] = None
    _read(request, path)
    # everything was read: now change the model, the optimizer and the random state
    loaded = {k[len(MODEL):]: v for k, v in request.items() if k.startswith(MODEL)}
    for key, names in _tied_groups(target, aliases).items():
        if key not in loaded:  # a tied weight saved under another of its names
            loaded[key] = next(loaded[a] for a in names if a in loaded)
    with torch.no_grad():
        model.load_state_dict(loaded, strict=True)
    if optimizer is not None:
        _set_optimizer_state(optimizer, request, slots)
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(_unblob(request[SCHEDULER]))
    meta = _unblob(request[META])
    _set_rng_state(_unblob(request[rng_key]))
    return Resumed(step=int(meta["step"]), data_state=meta.get("data_state"), path=path)


def _read(request: dict[str, Any], path: Path) -> None:
    try:
        with _quiet():
            dcp.load(request, checkpoint_id=path, no_dist=not _distributed())
    except (Exception, CheckpointException) as e:  # DCP's is not an Exception
        raise CheckpointError(
            f"{path} could not be read ({_first_line(e)}): the checkpoint is damaged or "
            f"incomplete; load another step ({_steps_text(path.parent)}) or save again"
            ) from e


def _resolve(directory: Path, step: int | None) -> Path:
    if step is None:
        found = latest_step(directory)
        if found is None:
            half = sorted(p.name for p in directory.glob("step-*.tmp")) if directory.is_dir() \
                else []
            why = (f"only {', '.join(half)}, a save that did not finish" if half else
                   "it does not exist" if not directory.exists() else "it holds none")
            raise CheckpointError(
                f"no committed checkpoint in {directory} ({why}): save one with "
                "autopar.checkpoint.save, or point at the directory that holds the run's")
        return step_dir(directory, found)
    path = step_dir(directory, step)
    if not (path / ".metadata").is_file():
        raise CheckpointError(
            f"no committed checkpoint of step {step} in {directory}: load one of "
            f"{_steps_text(directory)}, or step=None for the latest")
    return path


def _steps_text(directory: Path) -> str:
    steps = committed_steps(directory)
    return "steps " + ", ".join(map(str, steps)) if steps else "no committed step there"


def _read_metadata(path: Path) -> Any:
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:
        raise CheckpointError(
            f"{path} has an unreadable index ({_first_line(e)}): the checkpoint is damaged; "
            f"load another step ({_steps_text(path.parent)}) or save again") from e


def _check_model(path: Path, saved: dict, target: dict[str, Any], aliases: dict[str, str],
                 whole_keys: Any) -> None:
    """Refuse a checkpoint of another model before anything is read: keys missing or
    unexpected, shapes that differ. ``whole_keys``: every key of the whole model where this
    rank holds a part of them (a pipeline's ``model_keys``), else None."""
    have = {k[len(MODEL):] for k in saved if k.startswith(MODEL)}
    tied = _tied_groups(target, aliases)
    missing = [k for k in target if k not in have and not any(a in have for a in tied[k])]
    whole = set(target) if whole_keys is None else set(whole_keys)
    unexpected = [k for k in sorted(have) if k not in whole]
    shapes = []
    for k, v in target.items():
        md = saved.get(MODEL + k)
        if md is not None and hasattr(md, "size") and tuple(md.size) != tuple(v.shape):
            shapes.append(f"{k} saved {list(md.size)}, here {list(v.shape)}")
    if missing or unexpected or shapes:
        parts = ([f"{len(missing)} missing ({_some(missing)})"] * bool(missing)
                 + [f"{len(unexpected)} unexpected ({_some(unexpected)})"] * bool(unexpected)
                 + [f"{len(shapes)} of another shape ({_some(shapes)})"] * bool(shapes))
        raise CheckpointError(
            f"{path} was saved from another model: its entries differ from this model's "
            f"state dict, {'; '.join(parts)}: load it into the model it was saved from "
            "(same architecture and configuration)")


def _some(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f", ... {len(items) - n} more" if len(items) > n else "")


def _first_line(e: Any) -> str:
    """What went wrong, in a line (DCP's exception: the first failing rank's cause)."""
    if isinstance(e, CheckpointException) and e.failures:
        rank, cause = sorted(e.failures.items(), key=lambda kv: kv[0])[0]
        return f"rank {rank}: {_first_line(getattr(cause, 'exception', cause))}"
    return first_line(e)


# --- names, state, optimizer ---------------------------------------------------------------------


def model_state(model: nn.Module) -> dict[str, Any]:
    """The model's state dict under the single-device model's names (``ParallelModule`` and
    ``PipelineModule`` give those: this rank's entries, DTensors where sharded)."""
    return dict(model.state_dict())


def param_names(model: nn.Module) -> dict[int, str]:
    """Each parameter's single-device name, by ``id`` (a tied weight: its first name)."""
    return {i: names[0] for i, names in _all_param_names(model).items()}


def _all_param_names(model: nn.Module) -> dict[int, list[str]]:
    """Each parameter's single-device names, by ``id`` (a tied weight has several)."""
    named = (model.named_model_parameters() if hasattr(model, "named_model_parameters")
             else model.named_parameters(remove_duplicate=False))
    out: dict[int, list[str]] = {}
    for name, p in named:
        if name not in out.setdefault(id(p), []):
            out[id(p)].append(name)
    return out


def _name_of(p: torch.Tensor, names: dict[int, str]) -> str:
    name = names.get(id(p))
    if name is None:
        raise CheckpointError(
            f"the optimizer steps a tensor of shape {list(p.shape)} that is not a parameter "
            "of the model given: pass the model whose parameters the optimizer steps")
    return name


@dataclass(frozen=True)
class _Part:
    """One torch optimizer of ``optimizer`` and, for each tensor it steps, the model's
    parameter it stands for. ``local``: its tensors are host copies of this rank's pieces
    (an offloading plan's optimizer: ``runtime/optim/offload.py``)."""

    opt: Any
    pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    local: bool = False

    def param_of(self) -> dict[int, torch.Tensor]:
        return {id(t): p for t, p in self.pairs}


def _parts(optimizer: Any) -> list[_Part]:
    from autopar.runtime.optim.offload import OffloadedOptimizer

    if isinstance(optimizer, OffloadedOptimizer):
        parts = []
        if optimizer.device_opt is not None:
            parts.append(_Part(optimizer.device_opt,
                               tuple((p, p) for p in optimizer.on_device)))
        if optimizer.host_opt is not None:
            parts.append(_Part(optimizer.host_opt,
                               tuple(zip(optimizer.host, optimizer.moved)), local=True))
        return parts
    if not (hasattr(optimizer, "param_groups") and hasattr(optimizer, "state")
            and hasattr(optimizer, "load_state_dict")):
        raise CheckpointError(
            f"the optimizer is a {type(optimizer).__name__}, which has no param_groups, state "
            "and load_state_dict: pass a torch.optim.Optimizer (or the model's make_optimizer)")
    return [_Part(optimizer, tuple((p, p) for g in optimizer.param_groups
                                   for p in g["params"]))]


def _optimizer_entries(optimizer: Any, model: nn.Module) -> dict[str, Any]:
    """The optimizer's state and its groups' hyper-parameters, keyed by parameter name; a
    piece of offloaded state saved as the DTensor it is a piece of (so that it reshards)."""
    names = param_names(model)
    out: dict[str, Any] = {}
    for part in _parts(optimizer):
        param_of = part.param_of()
        for group in part.opt.param_groups:
            hyper = _blob({k: v for k, v in group.items() if k != "params"})
            for t in group["params"]:
                p = param_of[id(t)]
                name = _name_of(p, names)
                out[OPTIM_GROUP + name] = hyper
                for key, value in part.opt.state.get(t, {}).items():
                    if part.local:
                        value = _piece_as_whole(value, p)
                    out[f"{OPTIM_STATE}{name}.{key}"] = value if isinstance(
                        value, torch.Tensor) else _blob(value)
    return out


def _piece_as_whole(value: Any, p: torch.Tensor) -> Any:
    """A host tensor of this rank's piece's shape, as a DTensor placed like ``p``."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor) or not isinstance(value, torch.Tensor) or \
            value.dim() == 0 or value.shape != p.to_local().shape:
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _optimizer_request(optimizer: Any, model: nn.Module, saved: dict, tied: dict[str, str]
                       ) -> tuple[dict[str, Any], list]:
    """What to read for the optimizer: for each of its parameters the saved state's entries,
    into tensors placed like the parameter (or like its current state); the slots say where
    each goes. ``tied``: the saved model's tied names (alias -> the name its state is under),
    for a weight saved once and held here as a copy under another name (a pipeline's)."""
    if not any(k.startswith(OPTIM_STATE) or k.startswith(OPTIM_GROUP) for k in saved):
        raise CheckpointError(
            "the checkpoint holds no optimizer state (it was saved without an optimizer): "
            "load it without optimizer=, or save the optimizer with it")
    names = param_names(model)
    every = _all_param_names(model)
    saved_params = {k[len(OPTIM_STATE):].rpartition(".")[0] for k in saved
                    if k.startswith(OPTIM_STATE)} | \
        {k[len(OPTIM_GROUP):] for k in saved if k.startswith(OPTIM_GROUP)}
    request: dict[str, Any] = {}
    slots = []  # (part, tensor stepped, name, {state key: request key})
    for part in _parts(optimizer):
        for t, p in part.pairs:
            name = _name_of(p, names)
            here = every[id(p)]
            candidates = [*here, *(tied[n] for n in here if n in tied),
                          *(a for a, c in tied.items() if c in here)]
            name = next((n for n in candidates if n in saved_params), name)
            prefix = f"{OPTIM_STATE}{name}."
            keys = {k[len(prefix):]: k for k in saved
                    if k.startswith(prefix) and "." not in k[len(prefix):]}
            for key, full in keys.items():
                md = saved[full]
                have = None if part.local else part.opt.state.get(t, {}).get(key)
                if not hasattr(md, "size"):  # a saved object, not a tensor
                    request[full] = None
                elif isinstance(have, torch.Tensor) and tuple(have.shape) == tuple(md.size):
                    request[full] = _fresh_like(have)
                elif tuple(md.size) == tuple(p.shape):
                    request[full] = torch.empty_like(p.detach(), dtype=md.properties.dtype)
                else:  # a scalar (Adam's step) or a shape of its own: whole, on the host
                    request[full] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
            if OPTIM_GROUP + name in saved:
                request[OPTIM_GROUP + name] = None
            slots.append((part, t, name, keys))
    return request, slots


def _set_optimizer_state(optimizer: Any, request: dict, slots: list) -> None:
    """The state read, in torch's optimizer ``state_dict`` form (so that its own
    ``load_state_dict`` casts and places it), with each group's saved hyper-parameters; an
    offloading optimizer's host copies of the parameters refreshed from the model."""
    used: set[int] = set()
    for part in _parts(optimizer):
        mine = [(t, name, keys) for q, t, name, keys in slots if q.opt is part.opt]
        index = {id(t): i for i, (t, _, _) in enumerate(mine)}
        state = {}
        for i, (_t, _name, keys) in enumerate(mine):
            entry = {}
            for key, full in keys.items():
                value = request[full]
                if isinstance(value, torch.Tensor) and id(value) in used:
                    value = value.clone()  # two copies of a tied weight (a pipeline's)
                used.add(id(value))
                if part.local and hasattr(value, "to_local"):
                    value = value.to_local()  # this rank's piece, as the host optimizer keeps
                entry[key] = value if isinstance(value, torch.Tensor) else _unblob(value)
            if entry:
                state[i] = entry
        groups = []
        for group in part.opt.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            for t in group["params"]:
                blob = request.get(OPTIM_GROUP + mine[index[id(t)]][1])
                if blob is not None:
                    hyper.update(_unblob(blob))
                    break
            groups.append({**hyper, "params": [index[id(t)] for t in group["params"]]})
        part.opt.load_state_dict({"state": state, "param_groups": groups})
        if part.local:
            with torch.no_grad():
                for t, p in part.pairs:
                    t.copy_(p.to_local() if hasattr(p, "to_local") else p)


def _aliases(target: dict[str, Any]) -> dict[str, str]:
    """Each key whose tensor is also held under an earlier key (a tied weight) -> that key."""
    first: dict[int, str] = {}
    out = {}
    for key, value in target.items():
        if isinstance(value, torch.Tensor):
            canon = first.setdefault(id(value), key)
            if canon != key:
                out[key] = canon
    return out


def _tied_groups(target: dict[str, Any], aliases: dict[str, str]) -> dict[str, list[str]]:
    """Each key -> the other keys of the same tensor (none for an untied one)."""
    members: dict[str, list[str]] = {}
    for key, canon in aliases.items():
        members.setdefault(canon, [canon]).append(key)
    return {k: [a for a in members.get(aliases.get(k, k), []) if a != k] for k in target}


def _fresh_like(t: Any) -> Any:
    """An uninitialised tensor placed like ``t`` (a DTensor: the same mesh and placements)."""
    if isinstance(t, torch.Tensor):
        return torch.empty_like(t.detach())
    return None


# --- blobs, random state, process group -------------------------------------------------------


def _blob(obj: Any) -> bytes:
    return pickle.dumps(obj)


def _unblob(data: Any) -> Any:
    return pickle.loads(data) if isinstance(data, bytes) else data


def _rng_state() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                           "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"][:torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """DCP warns that it saves or loads in one process where no group is up: as meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")
        yield


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _world_size() -> int:
    return dist.get_world_size() if _distributed() else 1


_group_of: tuple[Any, Any] | None = None  # (the default group, the checkpoint's own group)


def _checkpoint_group() -> Any:
    """A gloo group of every rank for the checkpoint's own collectives, so that a background
    save never interleaves with the training's collectives on the default group. Made (by
    every rank, in the first save) once per default group."""
    global _group_of
    if not _distributed():
        return None
    default = dist.distributed_c10d._get_default_group()
    if _group_of is None or _group_of[0] is not default:
        _group_of = (default, dist.new_group(backend="gloo"))
    return _group_of[1]


def _barrier(group: Any) -> None:
    if group is not None:
        dist.barrier(group=group)
