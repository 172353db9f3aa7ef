"""Launch helpers: N local processes with a process group each, or join one torchrun made.

Two ways in, one environment inside:

* :func:`launch` spawns ``nproc`` processes on this machine (gloo over 127.0.0.1 on CPU, NCCL
  with one GPU per process where there are enough GPUs), sets the variables torchrun would set
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``), initialises the default process group, runs ``fn(*args)`` and returns each
  rank's result. Used by ``autopar train``, the examples and the tests.
* :func:`init_from_env` is what a script started by ``torchrun`` (one node or many) calls; it
  reads those same variables. Started by plain ``python`` it makes a one-process group, so the
  script still runs.

Nothing may hang: collectives time out (``collective_timeout_s``), the whole launch can have a
deadline (``timeout_s``), a rank that fails takes the others down, and the parent raises the
first rank's error (an :class:`~autopar.ir.errors.AutoparError` as itself, so the CLI prints its one
line; anything else as a :class:`LaunchError` that names the rank and carries its traceback).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.ir.errors import AutoparError, MeshError
from autopar.ir.mesh import Mesh


class LaunchError(AutoparError):
    """A launched rank failed, timed out or died; ``rank`` and ``child_traceback`` say where."""

    def __init__(self, message: str, rank: int | None = None, child_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.child_traceback = child_traceback


@dataclass(frozen=True, slots=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now. Another process can still take it before rank 0 binds it;
    :func:`launch` retries once with a fresh port when that happens."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_from_env(
    backend: str | None = None, collective_timeout_s: float = 300.0
) -> DistInfo:
    """Join the process group torchrun (or :func:`launch`) described in the environment.

    Idempotent. With no ``RANK``/``WORLD_SIZE`` set (plain ``python script.py``) it creates a
    one-process group on a free local port, so the same script runs without a launcher.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; None picks NCCL where CUDA is available, else gloo.
        collective_timeout_s: how long a collective may wait before the group fails it.

    Returns:
        This process's :class:`DistInfo`: rank, world size, local rank, backend and device
        (its GPU under NCCL, bound from ``LOCAL_RANK``; the CPU under gloo).

    Example:
        >>> import autopar
        >>> info = autopar.init_from_env()  # under torchrun --nproc-per-node 4 ...
        >>> info.world_size  # doctest: +SKIP
        4
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                               "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"})
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        backend = backend or default_backend()
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        kwargs: dict[str, Any] = _elastic_store(collective_timeout_s)
        if backend == "nccl":
            # Binding the device before init makes NCCL use one GPU per process (not all on 0).
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(
            backend, timeout=datetime.timedelta(seconds=collective_timeout_s), **kwargs
        )
    backend = str(dist.get_backend())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)


def restart_count() -> int:
    """How many times torchrun has restarted this group (0: the first attempt, or no torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def _elastic_store(timeout_s: float) -> dict[str, Any]:
    """Under torchrun's shared store: ``init_process_group``'s store, rank and world size, the
    store's keys this attempt's own (else nothing: torch's ``env://`` as it is).

    torchrun (torch >= 2.4) hosts one TCPStore in its agent for all of a run's attempts, and
    ``env://`` prefixes the keys with ``default_pg`` alone. After a restart
    (``--max-restarts``) a new rank can read the address a dead rank of the attempt before
    published, before the new one overwrites it, and fail to connect ("Gloo connectFullMesh
    failed ... Connection refused": the kill test of ``tests/cli/test_train_elastic.py``, on
    its restart). Keys under ``autopar/attempt_<TORCHELASTIC_RESTART_COUNT>`` keep the
    attempts apart, as torch's ``env://`` once did itself."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"autopar/attempt_{restart_count()}", store),
            "rank": int(os.environ["RANK"]), "world_size": int(os.environ["WORLD_SIZE"])}


def cleanup() -> None:
    """Destroy every process group, once all ranks got here (safe to call twice).

    The barrier first makes the end of a run safer: a rank that tears its gloo group down
    while a peer's gloo threads still talk to it can make that peer abort at exit
    ("terminate called without an active exception", torch's: a plain DDP script under
    torchrun on this machine, 2 exits in 8 without the barrier, none in 10 with it; the
    example script once in about 40 runs with it). Call it where every rank finished; after
    a failure the launcher (torchrun, :func:`launch`) stops the ranks. :func:`launch`'s own
    children skip the interpreter's exit altogether (``_child``)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


# --- the device mesh a plan runs on ------------------------------------------------------------

_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda", "fake": "cpu", "threaded": "cpu"}


def device_type() -> str:
    """The device type of the running process group's backend (``"cpu"``, ``"cuda"``)."""
    backend = str(dist.get_backend())
    return _BACKEND_DEVICE.get(backend, "cuda" if "nccl" in backend else "cpu")


def ensure_process_group(mesh: Mesh) -> None:
    """A process group for ``mesh``: the running one, torchrun's (from the environment), or a
    one-process group for a one-device mesh."""
    if dist.is_initialized():
        return
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        # NCCL with one GPU per process (LOCAL_RANK's) where CUDA is there, else gloo;
        # collectives time out after torch's default 10 minutes
        init_from_env(collective_timeout_s=600.0)
    elif mesh.size == 1:  # a single-device mesh needs no launcher
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        raise MeshError(
            f"mesh {mesh.describe()} has {mesh.size} devices but no process group is running: "
            f"launch with torchrun --nproc-per-node {mesh.size} (or call "
            "torch.distributed.init_process_group first)")


def resolve_mesh(mesh: Mesh | Any) -> tuple[Any, Mesh]:
    """The torch DeviceMesh to run on and the abstract Mesh to plan for."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if isinstance(mesh, DeviceMesh):
        return mesh, Mesh.from_device_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise MeshError(f"mesh must be an autopar.Mesh or a torch DeviceMesh, got {type(mesh)}")
    ensure_process_group(mesh)
    world = dist.get_world_size()
    if world != mesh.size:
        raise MeshError(
            f"mesh {mesh.describe()} has {mesh.size} devices but the process group has {world} "
            f"ranks: launch {mesh.size} processes (torchrun --nproc-per-node {mesh.size}) or use "
            f"a mesh of {world} devices")
    return init_device_mesh(device_type(), mesh.shape, mesh_dim_names=mesh.axes), mesh


def launch(
    fn: Callable[..., Any],
    nproc: int,
    args: Sequence[Any] = (),
    backend: str | None = None,
    timeout_s: float | None = None,
    collective_timeout_s: float = 300.0,
    threads_per_proc: int | None = None,
    start_method: str = "spawn",
) -> list[Any]:
    """Run ``fn(*args)`` on ``nproc`` local processes in one process group; their results.

    ``fn`` must be importable by name (a module-level function) because children are spawned,
    not forked: forking a parent that already runs OpenMP or gloo threads can deadlock the
    child. Each child gets ``threads_per_proc`` intra-op threads (default: the CPU cores
    divided among the ranks) so N ranks do not oversubscribe the cores N-fold.
    """
    if _importing_main_in_child():
        _mark_unguarded_call()
        raise _unguarded_call()
    if nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {nproc}")
    backend = backend or ("nccl" if _enough_gpus(nproc) else "gloo")
    threads = threads_per_proc or max(1, (os.cpu_count() or 1) // nproc)
    for attempt in range(2):
        try:
            return _launch_once(fn, nproc, tuple(args), backend, timeout_s,
                                collective_timeout_s, threads, start_method)
        except _PortTaken:
            if attempt == 1:
                raise LaunchError(
                    "could not bind a rendezvous port on 127.0.0.1 twice in a row; "
                    "another program is grabbing ports, try again"
                ) from None
    raise AssertionError("unreachable")


class _PortTaken(Exception):
    pass


_RUN_DIR_VAR = "AUTOPAR_LAUNCH_RUN_DIR"  # where a child importing the script reports to
_UNGUARDED_MARK = "unguarded-launch"


def _importing_main_in_child() -> bool:
    """This process was spawned and is still importing the parent's script (the check
    multiprocessing makes before it refuses to start processes from there)."""
    import multiprocessing

    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def _unguarded_call() -> LaunchError:
    """The error for a script that calls :func:`launch` at its top level: each spawned process
    imports the script again, and would launch processes of its own."""
    return LaunchError(
        "launch() ran while a launched process was importing the script that calls it: every "
        "process launch() starts imports that script again, so its top-level code runs in "
        "each of them; put the call (and whatever should run once) under "
        "`if __name__ == \"__main__\":`")


def _mark_unguarded_call() -> None:
    """In a child importing the script: leave a mark where the parent looks, so it raises
    :func:`_unguarded_call`'s error rather than "died without reporting"."""
    run_dir = os.environ.get(_RUN_DIR_VAR)
    if run_dir and Path(run_dir).is_dir():
        with contextlib.suppress(OSError):
            (Path(run_dir) / _UNGUARDED_MARK).touch()


def _enough_gpus(nproc: int) -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= nproc


def _launch_once(
    fn: Callable[..., Any], nproc: int, args: tuple, backend: str, timeout_s: float | None,
    collective_timeout_s: float, threads: int, start_method: str,
) -> list[Any]:
    run_dir = Path(tempfile.mkdtemp(prefix="autopar-launch-"))
    env = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    ctx = None
    saved_var = os.environ.get(_RUN_DIR_VAR)
    try:
        os.environ[_RUN_DIR_VAR] = str(run_dir)  # children inherit it while they import
        try:
            ctx = mp.start_processes(
                _child, args=(fn, args, env, backend, collective_timeout_s, threads,
                              str(run_dir)),
                nprocs=nproc, join=False, start_method=start_method,
            )
        finally:
            if saved_var is None:
                os.environ.pop(_RUN_DIR_VAR, None)
            else:
                os.environ[_RUN_DIR_VAR] = saved_var
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                if ctx.join(timeout=1.0, grace_period=5.0):
                    break
            except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
                raise _child_error(run_dir, nproc, e) from None
            if deadline is not None and time.monotonic() > deadline:
                _kill_all(ctx)
                raise LaunchError(
                    f"the {nproc} processes did not finish within {timeout_s:.0f} s and were "
                    "stopped; raise the time limit or make the run shorter"
                )
        return [_read(run_dir / f"result{r}.pkl") for r in range(nproc)]
    finally:
        if ctx is not None:
            _kill_all(ctx)  # KeyboardInterrupt or any error here: leave no orphans behind
        shutil.rmtree(run_dir, ignore_errors=True)


def _child(
    rank: int, fn: Callable[..., Any], args: tuple, env: dict[str, str], backend: str,
    collective_timeout_s: float, threads: int, run_dir: str,
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank)})
    torch.set_num_threads(threads)
    faulthandler.enable()  # a crash in native code (abort, segfault) prints where it happened
    phase = "init"
    try:
        init_from_env(backend, collective_timeout_s)
        phase = "run"
        result = fn(*args)
        phase = "teardown"
        cleanup()
        phase = "returning the result"
        _write(Path(run_dir) / f"result{rank}.pkl", result)
        code = 0
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        _write(Path(run_dir) / f"error{rank}.pkl", _ErrorRecord.of(e, rank, phase))
        # Exit without tearing the group down: a collective teardown would wait for peers
        # that may be stuck, and the parent kills them anyway.
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip the interpreter's own exit: once the result is written, native destructors of
    # torch.distributed's background threads can abort at exit (gloo, seen about once in six
    # benchmark runs: "terminate called without an active exception"), failing a finished run.
    os._exit(code)


@dataclass
class _ErrorRecord:
    rank: int
    phase: str
    when: float
    type_name: str
    message: str
    traceback: str
    exc: BaseException | None

    @classmethod
    def of(cls, e: BaseException, rank: int, phase: str) -> _ErrorRecord:
        exc: BaseException | None = e
        try:
            pickle.loads(pickle.dumps(e))
        except Exception:
            exc = None  # unpicklable exceptions travel as text only
        return cls(rank, phase, time.time(), type(e).__name__, str(e),
                   traceback.format_exc(), exc)


def _child_error(run_dir: Path, nproc: int, e: Exception) -> BaseException:
    records = [r for i in range(nproc) if (r := _read(run_dir / f"error{i}.pkl")) is not None]
    if not records and (run_dir / _UNGUARDED_MARK).exists():
        return _unguarded_call()
    if not records:
        rank = getattr(e, "error_index", None)
        return LaunchError(f"rank {rank} died without reporting an error ({e}); "
                           "it may have run out of memory or been killed", rank=rank)
    # The first failure is the cause; later ones are peers noticing the lost connection.
    first = min(records, key=lambda r: r.when)
    if first.phase == "init" and "address already in use" in first.message.lower():
        return _PortTaken()
    if isinstance(first.exc, AutoparError):
        return first.exc
    lines = first.message.strip().splitlines()
    detail = f": {lines[0]}" if lines else ""
    return LaunchError(f"rank {first.rank} failed: {first.type_name}{detail}",
                       rank=first.rank, child_traceback=first.traceback)


def _kill_all(ctx: Any) -> None:
    for p in ctx.processes:
        if p.is_alive():
            p.terminate()
    for p in ctx.processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()


def _write(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, path)  # atomic: the parent never reads half a file


def _read(path: Path) -> Any:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except FileNotFoundError:
        return None
