"""The device mesh of one rank: named axes, this rank's coordinate, and one Comm per axis.

Ranks are laid out row-major: the last (innermost) axis varies fastest, so with
`axes=("dp", "tp"), shape=(2, 4)` ranks 0..3 form the first tp group, and tp lands on
neighbouring ranks (the GPUs of one node), as the plan language promises.

A Mesh is built either inside a torchrun process (`Mesh.from_environment`, one ProcessGroup per
axis) or for the in-process simulator (`simulated_meshes`, one Mesh per rank sharing in-memory
ThreadGroups; run them with `run_in_threads`). Nothing here is global: the mesh is passed to
whatever needs a group.

Example (simulated, 2 x 2)::

    meshes = simulated_meshes(("dp", "tp"), (2, 2), timeout=10.0)
    sums = run_in_threads(meshes, lambda m: m.comm("tp").all_reduce(torch.ones(1)).item(), timeout=10.0)
    assert sums == [2.0, 2.0, 2.0, 2.0]
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .comm import Comm, ProcessGroupComm, ShapeComm, ThreadComm, ThreadGroup, solo_comm
from .agreement import job_id
from .errors import CollectiveContext, CollectiveTimeout, LaunchError
from .timeline import Timeline


def coord_of_rank(rank: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major coordinate of a global rank (last axis fastest)."""
    coord = []
    for size in reversed(shape):
        rank, c = divmod(rank, size)
        coord.append(c)
    return tuple(reversed(coord))


def rank_of_coord(coord: Sequence[int], shape: Sequence[int]) -> int:
    """Inverse of coord_of_rank."""
    rank = 0
    for c, size in zip(coord, shape):
        rank = rank * size + c
    return rank


def axis_groups(shape: Sequence[int], axis_index: int) -> list[tuple[int, ...]]:
    """All groups along one axis (global ranks, in group order), in a fixed order on every rank."""
    others = [range(s) if i != axis_index else range(1) for i, s in enumerate(shape)]
    groups = []
    for base in itertools.product(*others):
        coords = [base[:axis_index] + (i,) + base[axis_index + 1 :] for i in range(shape[axis_index])]
        groups.append(tuple(rank_of_coord(c, shape) for c in coords))
    return groups


@dataclass(frozen=True, eq=False)
class Mesh:
    """One rank's view of the mesh. Axes absent from `axes` behave as size-1 axes."""

    axes: tuple[str, ...]
    shape: tuple[int, ...]
    rank: int
    device: torch.device
    comms: Mapping[str, Comm] = field(repr=False)
    timeout: float = 300.0

    def __post_init__(self) -> None:
        _validate_axes(self.axes, self.shape)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a mesh of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def coord(self) -> tuple[int, ...]:
        return coord_of_rank(self.rank, self.shape)

    def size(self, axis: str) -> int:
        """Size of `axis` (1 if the mesh has no such axis); of a joint axis 'a+b', the product."""
        if axis in self.comms and self.comms[axis].size and "+" in axis:
            return self.comms[axis].size
        return self.shape[self.axes.index(axis)] if axis in self.axes else 1

    def coord_of(self, axis: str) -> int:
        """This rank's coordinate on `axis` (0 if the mesh has no such axis)."""
        return self.coord[self.axes.index(axis)] if axis in self.axes else 0

    def comm(self, axis: str) -> Comm:
        """The group of ranks that differ from this one only along `axis` (trivial if size 1)."""
        if axis in self.comms:
            return self.comms[axis]
        return solo_comm(axis, self.rank, self.timeout)

    def set_timeline(self, timeline: Timeline | None) -> None:
        """Record every collective of this rank's comms on `timeline` (None: stop recording)."""
        for comm in self.comms.values():
            comm.timeline = timeline

    def abort(self, reason: str) -> None:
        """Wake this rank's pending simulated collectives with a CollectiveError."""
        for comm in self.comms.values():
            comm.abort(reason)

    def reset(self) -> None:
        """Simulated groups usable again after a failed run in which every rank has stopped."""
        for comm in self.comms.values():
            if hasattr(comm, "reset"):
                comm.reset()

    def describe(self) -> str:
        """'dp=2 tp=4' — the mesh as the plan language writes it."""
        return " ".join(f"{a}={s}" for a, s in zip(self.axes, self.shape))

    # ------------------------------------------------------------------------ constructors
    @classmethod
    def from_environment(cls, axes: Sequence[str], shape: Sequence[int], *, timeout: float,
                         device: str | torch.device | None = None) -> Mesh:
        """This process's Mesh inside torchrun (or launch_local): one ProcessGroup per axis.

        The mesh owns the program's device: ``cuda:LOCAL_RANK`` when CUDA is available, else the
        CPU; `device` overrides it (``"cpu"`` runs gloo on a GPU machine). The CUDA device is made
        current *before* the default group is initialised (NCCL binds its communicators to the
        current device), then NCCL (CUDA) or gloo (CPU) is initialised if needed and every axis
        group is created in the same order on every rank, all with `timeout` seconds.
        """
        axes, shape = tuple(axes), tuple(int(s) for s in shape)
        _validate_axes(axes, shape)
        rank, world = _read_launch_env(axes, shape)
        device = _select_device(device)
        _init_default_group(device, rank, world, timeout)
        comms = {axis: _axis_comm(axes, shape, i, rank, timeout) for i, axis in enumerate(axes)}
        for joint, (merged, index) in _joint_axes(axes, shape).items():
            comms[joint] = _axis_comm(axes[:index] + (joint,) + axes[index + 2:], merged, index, rank, timeout)
        return cls(axes, shape, rank, device, comms, timeout)


JOINT_AXES = (("dp", "ep"),)  # neighbouring axes that also get one group spanning both


def _joint_axes(axes: tuple[str, ...], shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], int]]:
    """'dp+ep' -> (the mesh shape with dp and ep merged, their index): expert parallelism carves ep
    from the data-parallel ranks, and a gradient summed over all of them is one all-reduce over the
    merged group (ranks in data-parallel order, d * ep + e) rather than two."""
    out = {}
    for outer, inner in JOINT_AXES:
        if outer in axes and inner in axes and axes.index(inner) == axes.index(outer) + 1:
            i = axes.index(outer)
            if shape[i] > 1 and shape[i + 1] > 1:
                out[f"{outer}+{inner}"] = (shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2:], i)
    return out


def _validate_axes(axes: tuple[str, ...], shape: tuple[int, ...]) -> None:
    if len(axes) != len(shape):
        raise ValueError(f"mesh axes {axes} and shape {shape} have different lengths")
    if len(set(axes)) != len(axes):
        raise ValueError(f"mesh axes must be distinct, got {axes}")
    if any(not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"mesh sizes must be positive integers, got {shape}")


def _launch_command(axes: tuple[str, ...], shape: tuple[int, ...]) -> str:
    plan = " ".join(f"{a}={s}" for a, s in zip(axes, shape))
    return f"plan needs {math.prod(shape)} processes ({plan})"


def _read_launch_env(axes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, int]:
    """RANK and WORLD_SIZE from torchrun, checked against the mesh before any group is made."""
    need = math.prod(shape)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise LaunchError(
            f"{_launch_command(axes, shape)} but RANK/WORLD_SIZE are not set: this process was "
            f"not started by torchrun; launch with torchrun --nproc-per-node {need} SCRIPT, "
            f"call usc.runtime.launch.launch_local(fn, {need}), or use simulated_meshes()"
        )
    world = int(os.environ["WORLD_SIZE"])
    if world != need:
        raise LaunchError(
            f"{_launch_command(axes, shape)} but torchrun started {world}; "
            f"launch with torchrun --nproc-per-node {need} SCRIPT (or --nnodes N --nproc-per-node "
            f"{need}/N across nodes)"
        )
    return int(os.environ["RANK"]), world


def _select_device(requested: str | torch.device | None = None) -> torch.device:
    """The requested device, else cuda:LOCAL_RANK when CUDA is available, else the CPU; a CUDA
    device becomes the current one (collectives and allocations without an index land there)."""
    if requested is None:
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(requested)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError(f"device {device} was requested but CUDA is not available in this process; "
                              "pass device='cpu' (gloo) or run on a machine with GPUs")
        if device.index is None:  # modulo: a launcher may already show each process only its GPU
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise LaunchError(f"device {device}: usc runs ranks on 'cuda' (NCCL) or 'cpu' (gloo)")
    return device


def _init_default_group(device: torch.device, rank: int, world: int, timeout: float) -> None:
    if dist.is_initialized():
        if dist.get_world_size() != world:
            raise LaunchError(
                f"the default process group has {dist.get_world_size()} ranks, expected {world}"
            )
        return
    options = {"backend": "nccl", "device_id": device} if device.type == "cuda" else {"backend": "gloo"}
    # NCCL: the group timeout and async error handling let the watchdog abort a hung collective; the
    # waiting rank then sees the error, which Comm reports as a CollectiveError
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")  # 2: abort the communicators, raise in wait()
    try:
        store = _job_store(rank, world, timeout)
        if store is not None:
            options["store"] = store
        dist.init_process_group(rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout), **options)
    except dist.DistError as err:  # a store timeout, or the store's host gone (another job's rank 0 left)
        raise LaunchError(_rendezvous_failed(rank, world, timeout, err)) from err


def _job_store(rank: int, world: int, timeout: float):
    """The rendezvous store of this job alone when the launch names a job (runtime/agreement.py's
    JOB_ID_VARIABLES): every key lives under the job id, so a rank of another job that finds this port
    waits apart (and times out) instead of joining. None: torch's env:// rendezvous as it is."""
    job = job_id()
    if not job or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    # under torchrun's agent the store already exists: every rank connects to it as a client
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=host,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(f"usc-job/{job}/", store)


def _rendezvous_failed(rank: int, world: int, timeout: float, err: Exception) -> str:
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    job = job_id() or "(none named)"
    return (f"rank {rank} of job {job}: not all {world} ranks of this job met at {where} within {timeout:g}s "
            f"({type(err).__name__}: {str(err).splitlines()[0]}). Likely cause: a rank died or was not launched, "
            f"or ranks of two jobs share the port (a job's ranks meet only each other when USC_JOB_ID, "
            f"SLURM_JOB_ID or TORCHELASTIC_RUN_ID names the job); fix: launch every rank with the same job id "
            f"and a port no other job uses")


def _axis_comm(axes: tuple[str, ...], shape: tuple[int, ...], index: int, rank: int, timeout: float) -> Comm:
    """Create every group along axis `index` (new_group is collective over the world: all ranks
    must call it for every group, in the same order) and keep the one containing `rank`."""
    if shape[index] == 1:
        return solo_comm(axes[index], rank, timeout)
    mine = None
    for ranks in axis_groups(shape, index):
        group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=timeout))
        if rank in ranks:
            mine = group
    return ProcessGroupComm(mine, axes[index], timeout)


def simulated_meshes(axes: Sequence[str], shape: Sequence[int], *, timeout: float,
                     device: str | torch.device = "cpu") -> list[Mesh]:
    """One Mesh per rank for the in-process simulator; ranks of a group share a ThreadGroup.
    Every rank computes on `device` (one GPU can hold a whole simulated mesh)."""
    axes, shape = tuple(axes), tuple(int(s) for s in shape)
    _validate_axes(axes, shape)
    world = math.prod(shape)
    comms: list[dict[str, Comm]] = [{} for _ in range(world)]
    joint = {name: (merged, index) for name, (merged, index) in _joint_axes(axes, shape).items()}
    for axis, (groups_shape, index) in [(a, (shape, i)) for i, a in enumerate(axes)] + list(joint.items()):
        for ranks in axis_groups(groups_shape, index):
            group = ThreadGroup(ranks)
            for group_rank, rank in enumerate(ranks):
                comms[rank][axis] = ThreadComm(group, group_rank, axis=axis, timeout=timeout)
    return [Mesh(axes, shape, r, torch.device(device), comms[r], timeout) for r in range(world)]


def shape_mesh(axes: Sequence[str], shape: Sequence[int], rank: int, device: str | torch.device = "cpu") -> Mesh:
    """Rank `rank` alone, with peerless collectives of the right shapes (ShapeComm) on every axis
    and joint axis: one rank's program runs on fake tensors for any mesh size, on any device (a
    fake 'cuda' device on a machine without one)."""
    axes, shape, device = tuple(axes), tuple(int(s) for s in shape), torch.device(device)
    coord = coord_of_rank(rank, shape)
    comms: dict[str, Comm] = {a: ShapeComm(a, n, rank=c, device=device) for a, n, c in zip(axes, shape, coord)}
    for joint, (merged, index) in _joint_axes(axes, shape).items():
        inner = coord[index] * shape[index + 1] + coord[index + 1]
        comms[joint] = ShapeComm(joint, merged[index], rank=inner, device=device)
    return Mesh(axes, shape, rank, device, comms)


# ================================================================================ run_in_threads
class _Outcomes:
    """Results of the rank threads; remembers the first failure (the root cause)."""

    def __init__(self, world: int):
        self.world = world
        self.results: list[Any] = [None] * world
        self.first_error: tuple[int, BaseException] | None = None
        self.finished = 0
        self.cond = threading.Condition()

    def succeed(self, rank: int, result: Any) -> None:
        with self.cond:
            self.results[rank] = result
            self.finished += 1
            self.cond.notify_all()

    def fail(self, rank: int, exc: BaseException) -> bool:
        """Record a failure; True if it is the first one."""
        with self.cond:
            first = self.first_error is None
            if first:
                self.first_error = (rank, exc)
            self.finished += 1
            self.cond.notify_all()
        return first

    def wait(self, timeout: float) -> bool:
        """Until every rank finished or one failed; False if `timeout` passed first."""
        with self.cond:
            return self.cond.wait_for(lambda: self.finished == self.world or self.first_error, timeout)


def _rank_thread(mesh: Mesh, fn: Callable[[Mesh], Any], outcomes: _Outcomes, meshes: Sequence[Mesh]) -> None:
    try:
        # Backward runs on this thread, not on autograd's worker thread of the device: on a GPU every
        # simulated rank's backward would queue on cuda:0's one worker, and a collective that one
        # rank's backward waits in (a gradient hook's all-reduce, tp's backward all-reduce) would block
        # the peers' backward queued behind it -- a deadlock (seen on an H200 at dp=2). On the CPU
        # backward runs on the calling thread anyway. The setting is thread-local.
        with torch.autograd.set_multithreading_enabled(False):
            result = fn(mesh)
    except BaseException as exc:  # noqa: BLE001 - reported to the caller of run_in_threads
        # An error every rank raises at the same point (a non-finite global loss) needs no abort:
        # the peers are not waiting in a collective, and the groups stay usable afterwards.
        if outcomes.fail(mesh.rank, exc) and not getattr(exc, "raised_by_every_rank", False):
            reason = f"simulated rank {mesh.rank} failed first: {type(exc).__name__}: {exc}"
            for other in meshes:
                other.abort(reason)  # wake the peers blocked in collectives
        return
    outcomes.succeed(mesh.rank, result)


def run_in_threads(meshes: Sequence[Mesh], fn: Callable[[Mesh], Any], *, timeout: float) -> list[Any]:
    """Run fn(mesh) for every simulated rank in its own thread; results in rank order.

    If a rank raises, every group is aborted so the other ranks fail fast instead of waiting for
    it, and the first exception is re-raised here with a note naming its rank. If the ranks are
    not done within `timeout` seconds, the groups are aborted and CollectiveTimeout is raised.
    """
    outcomes = _Outcomes(len(meshes))
    threads = [
        threading.Thread(
            target=_rank_thread, args=(m, fn, outcomes, meshes), name=f"usc-rank{m.rank}", daemon=True
        )
        for m in meshes
    ]
    for thread in threads:
        thread.start()
    try:
        finished = outcomes.wait(timeout)
    except BaseException:  # Ctrl-C while the ranks run: wake them out of their collectives too
        for mesh in meshes:
            mesh.abort("interrupted")
        raise
    if not finished:
        _raise_hung(meshes, threads, timeout)
    if outcomes.first_error is not None:
        rank, exc = outcomes.first_error
        _settle(meshes, threads)
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"(raised on simulated rank {rank} of {len(meshes)})")
        raise exc
    for thread in threads:
        thread.join()
    return outcomes.results


# How long the peers of a failed simulated rank get to leave their aborted collectives before the
# groups are reset for the next call (they wake at once; a rank stuck in its own compute does not).
SETTLE_SECONDS = 5.0


def _settle(meshes: Sequence[Mesh], threads: list[threading.Thread]) -> None:
    """Once every rank thread has stopped, reset the groups: a failed step leaves the simulator usable
    (the executors roll their own state back). A thread still running keeps the groups aborted."""
    deadline = time.monotonic() + SETTLE_SECONDS  # one bound for all: several may be stuck
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    if not any(thread.is_alive() for thread in threads):
        for mesh in meshes:
            mesh.reset()


def _raise_hung(meshes: Sequence[Mesh], threads: list[threading.Thread], timeout: float) -> None:
    hung = [m.rank for m, t in zip(meshes, threads) if t.is_alive()]
    for mesh in meshes:
        mesh.abort(f"run_in_threads: ranks {hung} still running after {timeout:g}s")
    context = CollectiveContext(hung[0] if hung else 0, "run_in_threads", "*", tuple(hung), timeout)
    raise CollectiveTimeout(context, f"simulated ranks {hung} did not finish (deadlock or endless compute)")
