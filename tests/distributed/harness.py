"""Run a function on a small world of real gloo processes, failing fast.

`run_world(fn, world_size, *args)` starts `world_size` CPU processes from a forkserver that has
already imported torch (so each child starts in milliseconds, not seconds), gives each the
torchrun environment variables (RANK, WORLD_SIZE, MASTER_ADDR, a free MASTER_PORT ...), runs
`fn(rank, world_size, *args)` and returns the per-rank results in rank order.

Why not torch.multiprocessing.spawn or pytest-timeout: a distributed bug usually shows up as a
hang on the *other* ranks. Here the first failing rank's traceback is raised at once and every
other process is killed, and an overall deadline bounds the whole world, so a broken test fails
in seconds with the root cause instead of hanging the suite.

`fn` must be a module-level function (it is pickled by reference into the children).

Example::

    def _double(rank, world_size, x):
        return 2 * x + rank

    assert run_world(_double, 2, 10) == [20, 21]
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Collection
from multiprocessing.connection import Connection, wait
from typing import Any

# The forkserver imports these once; every child is forked from it with them already loaded
# (importing torch.distributed.tensor and the runtime in each child would cost seconds per world).
# A module that fails to import here is skipped silently by multiprocessing.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "usc.runtime.mesh",
    "usc.runtime.layout",
    "warm_ranks",  # torch.export, usc and one small lint: what every rank's first compile pays
]


class WorldFailure(RuntimeError):
    """A rank of a `run_world` world raised, died, or the world ran past its deadline."""

    def __init__(self, rank: int | None, detail: str):
        self.rank = rank
        who = f"rank {rank}" if rank is not None else "the world"
        super().__init__(f"{who} failed:\n{detail}")


def free_port() -> int:
    """A TCP port that was free a moment ago (the OS picks it; small race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, conn: Connection) -> None:
    """Child entry point: set the torchrun environment, run fn, send back ("ok"|"err", payload)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        conn.send(("ok", fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 - everything must reach the parent as text
        conn.send(("err", traceback.format_exc()))
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: a process group whose peer died can hang in its destructor.
    os._exit(0)


def _ensure_forkserver() -> None:
    """Start the forkserver with this directory importable: Python 3.11's forkserver ignores the
    parent's sys.path, so warm_ranks (which lives here) would otherwise fail to preload, silently."""
    from multiprocessing import forkserver

    saved = os.environ.get("PYTHONPATH")
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join([here] + ([saved] if saved else []))
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def _start(fn: Callable, world_size: int, args: tuple) -> tuple[list, list[Connection]]:
    """Start the processes; returns them and the parent ends of their result pipes."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    _ensure_forkserver()
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(fn, rank, world_size, port, args, child_end), daemon=True)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    return procs, conns


def _kill_all(procs: list) -> None:
    """Terminate every still-running process, then kill those that ignore SIGTERM."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2)


def _collect(procs: list, conns: list[Connection], deadline: float, may_die: Collection[int]) -> list[Any]:
    """Wait for every rank's message (or death); raise WorldFailure on the first failure."""
    results: dict[int, Any] = {}
    pending = set(range(len(procs)))
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WorldFailure(None, f"deadline passed; ranks {sorted(pending)} did not finish (hang?)")
        ready = wait([conns[r] for r in pending] + [procs[r].sentinel for r in pending], timeout=remaining)
        for rank in sorted(pending):
            if conns[rank] not in ready and procs[rank].sentinel not in ready:
                continue
            message = _receive(conns[rank])
            if message is None and procs[rank].is_alive():
                continue  # the pipe woke us but the process is still finishing
            if message is None and rank not in may_die:
                procs[rank].join(timeout=1)
                raise WorldFailure(rank, f"process died with exit code {procs[rank].exitcode}")
            if message is not None and message[0] == "err":
                raise WorldFailure(rank, message[1])
            results[rank] = None if message is None else message[1]
            pending.discard(rank)
    return [results[r] for r in range(len(procs))]


def _receive(conn: Connection) -> tuple[str, Any] | None:
    """The rank's ("ok"|"err", payload) message, or None if it has sent nothing (or died)."""
    try:
        return conn.recv() if conn.poll() else None
    except EOFError:
        return None


def run_world(
    fn: Callable, world_size: int, *args: Any, timeout: float = 60.0, may_die: Collection[int] = ()
) -> list[Any]:
    """Run fn(rank, world_size, *args) on world_size gloo-ready processes; results in rank order.

    Raises WorldFailure with the failing rank's traceback text as soon as one rank raises or
    dies (ranks in `may_die` may exit without a result: theirs is None), or when `timeout`
    seconds pass; every other process is killed first, so a bug never hangs the caller.
    """
    procs, conns = _start(fn, world_size, args)
    try:
        return _collect(procs, conns, time.monotonic() + timeout, may_die)
    finally:
        _kill_all(procs)
        for conn in conns:
            conn.close()
