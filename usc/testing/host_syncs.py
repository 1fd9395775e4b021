"""Count the host syncs a program would make on a GPU, on a machine without one.

On CUDA the host runs ahead of the device until something needs a value the device has not
computed yet: a tensor read as a Python number (``item``, ``float``, ``bool``, ``tolist``), an op
whose output size depends on the data (``nonzero``, boolean indexing, ``bincount``, ``unique``,
``repeat_interleave`` without ``output_size``), or a tensor made from host data (``torch.tensor``:
a blocking host-to-device copy). Each is a *host sync*; ``torch.cuda.set_sync_debug_mode`` reports
them on a GPU. On the CPU nothing waits, so this module counts the same operations instead: a
dispatch mode sees the ATen ops, and ``Tensor.tolist`` / ``Tensor.numpy`` (which read CPU memory
without an op) are wrapped. The simulator's rank threads are watched too, each as its own rank.

Example::

    with record_host_syncs() as syncs:
        sim.step(tokens, labels)
    per_rank = Counter(s.thread for s in syncs)
"""

from __future__ import annotations

import threading
import traceback
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# ATen ops that make the host wait for the device on CUDA, and why.
SYNCING_OPS = {
    aten._local_scalar_dense.default: "a tensor read as a Python number (item, float, int, bool)",
    aten.equal.default: "a tensor comparison read on the host",
    aten.nonzero.default: "output size depends on the data (nonzero, boolean indexing)",
    aten.masked_select.default: "output size depends on the data",
    aten.bincount.default: "output size (max + 1) depends on the data",
    aten._unique2.default: "output size depends on the data",
    aten.unique_consecutive.default: "output size depends on the data",
    aten.unique_dim.default: "output size depends on the data",
    aten.lift_fresh.default: "a tensor made from host data (torch.tensor): a blocking host-to-device copy",
}


@dataclass(frozen=True)
class HostSync:
    what: str  # the op or method
    thread: str  # the simulated rank's thread (usc-rank<N>) or the caller's
    where: str  # the innermost frame of usc code that asked for it

    def __str__(self) -> str:
        return f"{self.what} on {self.thread} at {self.where}"


# Reads of tensors kept on the host by design, which wait for no device: the step counter of
# torch's optimizers (on the CPU unless capturable or fused; Adam reads it with .item()), and the
# batch's index check, which reads the user's batch only while it is still a CPU tensor (a batch
# already on an accelerator is checked there by the ops themselves: runtime/input_checks.py).
HOST_OWNED = ("torch/optim/", "runtime/input_checks.py")
_OURS = ("/runtime/", "/usc/", "/passes/", "/compiler/")


def _where(stack: list[traceback.FrameSummary]) -> str:
    frames = [f for f in stack if "/usc/testing/" not in f.filename and any(p in f.filename for p in _OURS)]
    frame = frames[-1] if frames else stack[-1]
    return f"{frame.filename.rsplit('/', 2)[-2]}/{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"


class _Recorder:
    def __init__(self) -> None:
        self.syncs: list[HostSync] = []
        self.lock = threading.Lock()

    def add(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        if any(owned in f.filename for f in stack for owned in HOST_OWNED):
            return
        sync = HostSync(what, threading.current_thread().name, _where(stack))
        with self.lock:
            self.syncs.append(sync)


class _SyncMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _is_fake(args):
            if func in SYNCING_OPS:
                self.recorder.add(str(func).replace("aten.", ""))
            elif func in SYNCING_WHEN and SYNCING_WHEN[func][0](args, kwargs):
                self.recorder.add(SYNCING_WHEN[func][1])
        return func(*args, **kwargs)


def _bool_index(args, kwargs) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])


# ATen ops that sync only with some arguments: (test, what is recorded)
SYNCING_WHEN = {
    aten.repeat_interleave.Tensor: (lambda args, kwargs: kwargs.get("output_size") is None,
                                    "repeat_interleave without output_size"),
    aten.index.Tensor: (_bool_index, "boolean indexing (output size depends on the data)"),
    aten.index_put_.default: (_bool_index, "boolean index_put_ (a nonzero inside)"),
    aten.index_put.default: (_bool_index, "boolean index_put (a nonzero inside)"),
}


def _is_fake(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(a, FakeTensor) for a in args)


def _wrap_reader(name: str, recorder: _Recorder):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        recorder.add(f"Tensor.{name}")
        return original(self, *args, **kwargs)
    return read


@contextmanager
def record_host_syncs() -> Iterator[list[HostSync]]:
    """Record every host sync made inside, in this thread and in the simulator's rank threads."""
    from usc.runtime import mesh as mesh_module

    recorder = _Recorder()
    rank_thread = mesh_module._rank_thread

    def watched_rank(mesh, fn, outcomes, meshes):
        with _SyncMode(recorder):
            rank_thread(mesh, fn, outcomes, meshes)

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(mesh_module, "_rank_thread", watched_rank))
        for name in ("tolist", "numpy"):
            stack.enter_context(mock.patch.object(torch.Tensor, name, _wrap_reader(name, recorder)))
        stack.enter_context(_SyncMode(recorder))
        yield recorder.syncs
