"""runtime/launch.py: spawning local process groups, surfacing child errors, never hanging.

The worker functions live at module level because children are spawned and find them by name.
Each launch costs a few seconds (every child imports torch), so the tests launch sparingly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from autopar.ir.errors import AutoparError, MeshError
from autopar.runtime.launch import LaunchError, free_port, launch

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _sum_ranks(offset: float) -> dict:
    t = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(t)
    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item(),
            "backend": str(dist.get_backend()), "threads": torch.get_num_threads(),
            "env": {k: os.environ.get(k) for k in ENV}}


def _rank1_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank one cannot go on")
    dist.barrier()  # rank 0 waits here for a peer that is gone: must not hang the launch


def _rank0_raises_autopar_error() -> None:
    if dist.get_rank() == 0:
        raise MeshError("mesh dp=3 has 3 devices but the process group has 2 ranks")
    dist.barrier()


def _sleeps() -> None:
    time.sleep(600)


def test_results_env_and_collectives() -> None:
    out = launch(_sum_ranks, 2, args=(10.0,), threads_per_proc=1)
    assert [r["rank"] for r in out] == [0, 1]
    for r in out:
        assert r["world"] == 2 and r["sum"] == 21.0 and r["backend"] == "gloo"
        assert r["threads"] == 1
        env = r["env"]
        assert env["RANK"] == str(r["rank"]) == env["LOCAL_RANK"]
        assert env["WORLD_SIZE"] == "2" == env["LOCAL_WORLD_SIZE"]
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
    assert out[0]["env"]["MASTER_PORT"] == out[1]["env"]["MASTER_PORT"]


def test_child_error_names_rank_and_keeps_traceback() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(_rank1_raises, 2, timeout_s=120)
    assert time.monotonic() - t0 < 60  # the survivor in barrier() was stopped, not waited on
    err = info.value
    assert err.rank == 1
    assert str(err) == "rank 1 failed: ValueError: rank one cannot go on"
    assert "_rank1_raises" in err.child_traceback


def test_autopar_errors_cross_as_themselves() -> None:
    # so the CLI prints the child's one-line message, not a wrapped traceback
    with pytest.raises(MeshError, match="3 devices but the process group has 2"):
        launch(_rank0_raises_autopar_error, 2, timeout_s=120)


def test_deadline_stops_everything() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within 3 s"):
        launch(_sleeps, 2, timeout_s=3)
    assert time.monotonic() - t0 < 45


def test_bad_nproc_is_a_clear_error() -> None:
    with pytest.raises(LaunchError, match="nproc must be at least 1"):
        launch(_sleeps, 0)
    assert issubclass(LaunchError, AutoparError)


def test_launch_at_a_scripts_top_level_names_the_guard(tmp_path) -> None:
    """Each spawned child imports the script again; a launch() at its top level must say so
    (multiprocessing's own error reaches only the children's stderr)."""
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent("""
        from autopar.runtime.launch import launch
        def work():
            return 1
        print("results", launch(work, 2, timeout_s=60))
    """))
    full = {k: v for k, v in os.environ.items() if k not in ENV}
    r = subprocess.run([sys.executable, str(script)], env=full, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("autopar.runtime.launch.LaunchError: launch() ran while"), r.stderr
    assert 'if __name__ == "__main__":' in last
    assert "results" not in r.stdout


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def _run_script(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ENV} | env
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full,
                          capture_output=True, text=True, timeout=120)


_INIT_SCRIPT = """
    import torch.distributed as dist
    from autopar.runtime.launch import cleanup, init_from_env
    info = init_from_env()
    again = init_from_env()  # idempotent
    print(info.rank, info.world_size, info.local_rank, info.backend, info.device, again == info)
    cleanup(); cleanup()
    print(dist.is_initialized())
"""


def test_init_from_env_without_launcher_makes_one_process_group() -> None:
    # (with torchrun's variables set it is what every launched child above already ran)
    r = _run_script(_INIT_SCRIPT, {})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["0", "1", "0", "gloo", "cpu", "True", "False"]
