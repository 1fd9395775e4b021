"""Run one rank's whole program on a device this machine does not have: the fake-CUDA tier.

Under torch's FakeTensorMode a tensor can live on ``cuda`` without a GPU (only its shape, dtype and
device exist), and an op that mixes a CUDA and a CPU tensor raises as it would on a GPU. But in a
CPU-only build autograd cannot record on a fake ``cuda`` tensor (it asks the missing CUDA device
guard for a stream and aborts the process), and ``clone``/``copy_`` of one raise the same way, so
the ranks run on ``fake_accelerator()``: PyTorch's PrivateUse1 backend registered from Python
under the name "fakegpu", a non-CPU device with the same mixing rules and a device guard. With
peerless collectives of the right shapes (``runtime.mesh.shape_mesh``), any rank of any plan runs
its forward, backward, gradient reduction, optimizer step and checkpoint save/load that way, while
a dispatch mode records every tensor an op produces on another device than the program's: the
tensors the runtime creates must all be on the program's device, even 0-dim ones (CUDA accepts a
0-dim CPU operand, so a mix alone would not show them).

Example::

    compiled = usc.compile(model, "dp=2 tp=2", example_inputs=batch)
    report = run_fake_rank(compiled, rank=3, device=fake_accelerator())
    assert report.wrong == []
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from usc.runtime.mesh import shape_mesh

# Where torch itself keeps a tensor on the CPU by design: Adam's non-capturable 'step' counter.
_TORCH_OWNED = ("torch/optim/",)


FAKE_ACCELERATOR = "fakegpu"


def fake_accelerator() -> str:
    """A second device for this process ('fakegpu:0'), registered once: autograd works on it."""
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    if torch._C._get_privateuse1_backend_name() != FAKE_ACCELERATOR:
        _setup_privateuseone_for_python_backend(FAKE_ACCELERATOR)
    return f"{FAKE_ACCELERATOR}:0"


def autograd_works_on(device: str) -> bool:
    """Fake CUDA tensors cannot take part in autograd (nor copy_) without a CUDA build."""
    return torch.device(device).type != "cuda" or torch.cuda.is_available()


# torch.tensor(data) hands its host copy of the data to these: a creation, whatever the input
_CREATIONS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


@dataclass
class WrongDevice:
    op: str
    shape: tuple[int, ...]
    device: str
    where: str  # the innermost frame of usc code that ran the op

    def __str__(self) -> str:
        return f"{self.op} -> {list(self.shape)} on {self.device} at {self.where}"


class DeviceWatch(TorchDispatchMode):
    """Records every tensor an op *creates* off `device` (with the frame that made it): an output
    elsewhere when no input tensor was there. Views and slices of the user's CPU model and batch,
    on their way to the device, are not creations; a factory call without a device is."""

    def __init__(self, device: str):
        super().__init__()
        self.device = torch.device(device).type
        self.wrong: list[WrongDevice] = []
        self.enabled = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.enabled:
            return out
        sources = set() if func in _CREATIONS else \
            {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != self.device and t.device.type not in sources:
                where = _usc_frame()
                if where is not None:
                    self.wrong.append(WrongDevice(str(func), tuple(t.shape), str(t.device), where))
        return out


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def _usc_frame() -> str | None:
    """file:line of the innermost frame of this project (or of the program's generated graph code),
    None when torch's own code chose the device (see _TORCH_OWNED)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename
        if any(part in path.replace(os.sep, "/") for part in _TORCH_OWNED):
            return None
        if path.startswith("<eval_with_key>"):
            return f"the program's graph ({path}:{frame.lineno}: {frame.line or ''})"
        if path.startswith(_ROOT) and not path.endswith("fake_device.py"):
            return f"{os.path.relpath(path, _ROOT)}:{frame.lineno}"
    return None


@dataclass
class FakeRankReport:
    """What one fake rank did: the losses it returned, and the tensors on the wrong device."""

    rank: int
    steps: int = 0
    wrong: list[WrongDevice] = field(default_factory=list)
    state_devices: set[str] = field(default_factory=set)


def run_fake_rank(compiled, rank: int, *, device: str, steps: int = 2,
                  checkpoint: bool = True, optimizer=None) -> FakeRankReport:
    """Run rank `rank` of `compiled` (built with example_inputs) on fake tensors on `device`:
    `steps` training steps, an evaluation, then a checkpoint save and load. The model's state and
    the batch start on the CPU, as a user builds them; the program must move them. On a fake
    'cuda' device without CUDA, steps must be 0 (see the module doc)."""
    if steps and not autograd_works_on(device):
        raise ValueError(f"training steps need autograd, which a fake {device} cannot record in a "
                         f"CPU-only build: use fake_accelerator(), or steps=0")
    from torch._subclasses.fake_tensor import FakeTensorMode

    program = compiled.program
    mesh = shape_mesh(program.mesh.axes, program.mesh.shape, rank, device)
    report = FakeRankReport(rank)
    # capturable: Adam's step counter on the device too (a real CPU 'step' cannot be moved to a
    # fake device: torch runs ops on all-real inputs for real, on a backend that has no kernels)
    factory = optimizer or (lambda params: torch.optim.AdamW(params, lr=1e-3, capturable=True))
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {}
        for spec in program.state:
            tensor = torch.zeros(spec.global_shape, dtype=spec.dtype)
            state[spec.name] = torch.nn.Parameter(tensor) if spec.kind == "param" and spec.trainable else tensor
        mb = int(compiled.plan.get("mb"))  # the program is compiled for one microbatch
        batch = tuple(torch.zeros((spec.global_shape[0] * mb, *spec.global_shape[1:]), dtype=spec.dtype)
                      for spec in program.inputs)
        watch = DeviceWatch(device)
        with watch:
            executor = compiled._make_executor(mesh, state, factory)
            executor._to_host = lambda value, assumed=1.0: _fake_host(value, device, assumed)
            for _ in range(steps):
                executor.step(batch)
                report.steps += 1
            executor.evaluate(batch)
            if checkpoint:
                tensors, meta = executor.checkpoint_state()
                if autograd_works_on(device):
                    watch.enabled = False  # a checkpoint read from disk arrives on the CPU
                    on_disk = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in tensors.items()}
                    watch.enabled = True
                    executor.load_checkpoint_state(on_disk, meta)
        report.wrong = watch.wrong
        report.state_devices = {str(t.device) for t in executor.state.values()}
        inner = getattr(executor.optimizer, "inner", executor.optimizer)
        report.state_devices |= {str(t.device) for s in inner.state.values() for t in s.values()
                                 if isinstance(t, torch.Tensor) and t.dim() > 0}
    return report


def _fake_host(value: torch.Tensor, device: str, assumed: float) -> float:
    """A host sync on a fake tensor: checks the value is on the device, returns what the caller
    assumes it holds."""
    if value.device.type != torch.device(device).type:
        raise AssertionError(f"a value synced to the host is on {value.device}, not on {device}")
    return float(assumed)
