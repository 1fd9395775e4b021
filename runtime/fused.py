"""The fused node: one region of the graph run as one generated Triton kernel (forward and backward).

``FusedRegion`` holds the region's eager sub-graph (the ops it replaces) and the kernel source the
compiler generated for it. On CUDA the kernels run compiled; on CPU they run under Triton's
interpreter when ``TRITON_INTERPRET=1`` was set before triton was imported. Without triton, or
on a device it cannot use, the node runs its eager ops instead, with a one-line notice (once per
process and reason), never an error.

Whichever way it runs, the node saves only its inputs for backward (the whole point of fusion:
intermediates stay in registers) and computes its backward from them: the generated backward
kernel, or the eager ops recomputed under autograd.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import math
import os
import sys
import threading
from dataclasses import dataclass

import torch
import torch.fx as fx

from .kernel_cache import kernel_file

_NOTICES: set[str] = set()
_KERNELS: dict[str, object] = {}  # kernel name (the hash of its source) -> loaded module
_INTERPRETER_LOCK = threading.Lock()  # Triton's interpreter patches module globals while it runs


@dataclass(frozen=True)
class Load:
    """A region input as the kernel reads it: broadcast to a whole row ('vec'), or one value per
    row ('row': shape [..., 1]; 'flat': the leading shape), and whether the kernel writes its grad."""

    input: int
    domain: str
    grad: bool
    is_float: bool = True  # converted to the compute dtype (floats, bool masks); labels stay integers


@dataclass(frozen=True)
class Store:
    domain: str  # 'vec' | 'row' | 'flat'


@dataclass(frozen=True)
class KernelSource:
    name: str
    source: str
    signature: str
    loads: tuple[Load, ...]
    stores: tuple[Store, ...]
    lead_rank: int
    compute_dtype: str = "float32"  # what the kernel computes in (float64 models: float64)

    @property
    def forward_name(self) -> str:
        return f"{self.name}_fwd"

    @property
    def backward_name(self) -> str:
        return f"{self.name}_bwd"


def notice(reason: str) -> None:
    """One line on stderr, once per process and reason."""
    if reason not in _NOTICES:
        _NOTICES.add(reason)
        print(f"usc: fused kernels fall back to eager ops: {reason}", file=sys.stderr)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@contextlib.contextmanager
def _without_overflow_checks():
    """Triton's interpreter checks every 32-bit integer add and multiply of a kernel for overflow
    (``sanitize_overflow``; a compiled kernel drops those checks unless built with debug=True), which
    is a third of an interpreted launch's time. Our launches run without them, as compiled; any other
    kernel the process interprets keeps its checks (held under _INTERPRETER_LOCK)."""
    try:
        from triton.runtime import interpreter
        builder = interpreter.interpreter_builder
        options = builder.options
        unchecked = dataclasses.replace(options, sanitize_overflow=False)
    except (ImportError, AttributeError, TypeError):  # another triton: its own defaults
        yield
        return
    builder.options = unchecked
    try:
        yield
    finally:
        builder.options = options


def kernel_backend(tensors) -> str | None:
    """'cuda', 'interpreter', or None (eager) with a notice saying why."""
    from torch._subclasses.fake_tensor import FakeTensor

    if any(isinstance(t, FakeTensor) or t.device.type == "meta" for t in tensors):
        return None  # shape propagation (the report's estimate): no kernel runs
    try:
        import triton  # noqa: F401
    except ImportError:
        notice("triton is not installed (pip install triton)")
        return None
    if all(t.device.type == "cuda" for t in tensors):
        return "cuda"
    if all(t.device.type == "cpu" for t in tensors) and _interpreting():
        return "interpreter"
    notice("no CUDA device for the kernels (on CPU set TRITON_INTERPRET=1 before importing triton)")
    return None


def load_kernel(kernel: KernelSource):
    """The module holding the kernel's two @triton.jit functions, loaded once per name. Triton
    reads a kernel's source from its file, so the source is written to a cache directory."""
    module = _KERNELS.get(kernel.name)
    if module is not None:
        return module
    path = kernel_file(kernel.name, kernel.source)  # private directory, content checked
    spec = importlib.util.spec_from_file_location(f"usc_kernel_{kernel.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _KERNELS[kernel.name] = module
    return module


def _row_shape(lead: tuple[int, ...], length: int, domain: str) -> tuple[int, ...]:
    return {"vec": lead + (length,), "row": lead + (1,), "flat": lead}[domain]


# Columns per tile: a longer row loops over tiles, so registers stay bounded at any row length.
MAX_BLOCK = 8192
# (smallest tile, warps per program): wider tiles get more warps so each thread holds a bounded
# number of columns (the table of Liger kernels' ``calculate_settings``).
WARPS = ((32768, 32), (8192, 16), (2048, 8), (0, 4))
# Programs when gradients are accumulated per program: a few resident blocks per SM fill the GPU
# (Liger's RMSNorm backward uses one per SM); the interpreter runs the grid as a Python loop.
PROGRAMS_PER_SM = 4
HOST_PROGRAMS = 8


def launch_config(length: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``length`` columns."""
    block = min(triton_next_power_of_2(max(length, 1)), MAX_BLOCK)
    return block, next(warps for least, warps in WARPS if block >= least)


def accumulating_programs(device: torch.device, rows: int) -> int:
    """The grid of a backward that accumulates a broadcast input's gradient per program."""
    if device.type == "cuda":
        cap = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    else:
        cap = HOST_PROGRAMS
    return max(min(rows, cap), 1)


class _Launch:
    """Arguments of one launch: broadcast strides of every load, the row space, the tile."""

    def __init__(self, kernel: KernelSource, inputs: tuple[torch.Tensor, ...], row_shape: tuple[int, ...]) -> None:
        self.kernel = kernel
        self.lead, self.length = tuple(row_shape[:-1]), row_shape[-1]
        self.rows = 1
        for d in self.lead:
            self.rows *= d
        self.args: list = []
        for load in kernel.loads:
            t = inputs[load.input]
            view = t.broadcast_to(_row_shape(self.lead, self.length, load.domain)) if load.domain != "flat" \
                else t.broadcast_to(self.lead)
            strides = list(view.stride())
            self.args += [t] + strides[:len(self.lead)] + ([strides[-1]] if load.domain == "vec" else [])
        self.block, self.warps = launch_config(self.length)

    def dims(self) -> list[int]:
        return [*self.lead, self.length]

    def output_args(self, outs: list[torch.Tensor]) -> list:
        """Forward outputs: a whole-row output is written at its own strides."""
        args: list = []
        for store, t in zip(self.kernel.stores, outs):
            args.append(t)
            if store.domain == "vec":
                strides = list(t.stride())
                args += strides[:len(self.lead)] + [strides[-1]]
        return args

    def run(self, fn, tensors: list, *, programs: int | None = None, flags: dict | None = None) -> None:
        args = [*self.args, *tensors, *self.dims()]
        grid = (programs or max(self.rows, 1),)
        options = dict(flags or {}, ONE_TILE=self.length <= self.block, BLOCK=self.block, num_warps=self.warps)
        if tensors and tensors[0].device.type == "cpu":
            with _INTERPRETER_LOCK, _without_overflow_checks():
                fn[grid](*args, **options)
        else:
            fn[grid](*args, **options)


@dataclass
class _GradBuffer:
    """Where the backward kernel writes one input's gradient. An input broadcast over rows (a norm
    weight) gets one float32 copy of its own shape per program, summed here afterwards: never a
    [rows, length] buffer. Any other input's gradient is written once per element, in its dtype."""

    input: torch.Tensor
    buffer: torch.Tensor
    args: list
    accumulate: bool

    @staticmethod
    def make(t: torch.Tensor, load: Load, launch: _Launch, programs: int, compute: torch.dtype) -> "_GradBuffer":
        shape = _row_shape(launch.lead, launch.length, load.domain)
        accumulate = t.numel() < math.prod(shape)
        if accumulate:
            buffer = torch.zeros((programs, *t.shape), dtype=compute, device=t.device)
            per_program, view = buffer.stride(0), buffer[0].broadcast_to(shape)
        else:
            buffer = torch.empty(t.shape, dtype=t.dtype, device=t.device)
            per_program, view = 0, buffer.broadcast_to(shape)
        strides = list(view.stride())
        args = [buffer, per_program] + strides[:len(launch.lead)] + ([strides[-1]] if load.domain == "vec" else [])
        return _GradBuffer(t, buffer, args, accumulate)

    def result(self) -> torch.Tensor:
        return (self.buffer.sum(0) if self.accumulate else self.buffer).to(self.input.dtype)


def _dense(t: torch.Tensor) -> bool:
    """Its elements fill its storage span exactly, in some dim order (a permuted contiguous tensor)."""
    expected = 1
    for d in sorted(range(t.dim()), key=t.stride):
        if t.size(d) == 1:
            continue
        if t.stride(d) != expected:
            return False
        expected *= t.size(d)
    return True


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class FusedRegion(torch.nn.Module):
    """One fused region: ``forward(*inputs)`` returns the tuple of the region's outputs."""

    def __init__(self, eager: fx.GraphModule, kernel: KernelSource | None, *, row_shape: tuple[int, ...],
                 out_shapes: tuple[tuple[int, ...], ...], label: str = "") -> None:
        super().__init__()
        self.eager = eager
        self.kernel = kernel
        self.row_shape = tuple(row_shape)
        self.out_shapes = tuple(tuple(s) for s in out_shapes)
        self.label = label
        self.launches = {"forward": 0, "backward": 0}  # kernels this node ran (eager runs count none)

    @property
    def fused_region(self) -> fx.GraphModule:
        """The ops this node replaces (read by the report's cost model)."""
        return self.eager

    def forward(self, *inputs):
        return _FusedFunction.apply(self, *inputs)

    # ----------------------------------------------------------------- the two ways to run
    def run_forward(self, inputs: tuple) -> tuple[torch.Tensor, ...]:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        backend = kernel_backend(tensors) if self.kernel is not None else None
        if backend is None:
            with torch.no_grad():
                return tuple(self.eager(*inputs))
        module = load_kernel(self.kernel)
        launch = _Launch(self.kernel, inputs, self._row_shape(inputs))
        outs = [self._new_output(k, dtype, inputs) for k, dtype in enumerate(self._out_dtypes(inputs))]
        launch.run(getattr(module, self.kernel.forward_name), launch.output_args(outs))
        self.launches["forward"] += 1
        return tuple(outs)

    def _new_output(self, k: int, dtype: torch.dtype, inputs: tuple) -> torch.Tensor:
        """Laid out like an input of the same shape, as eager pointwise ops do (a later ``view`` of
        the output then works exactly when it worked on the eager output)."""
        shape = self.out_shapes[k]
        like = [t for t in inputs if isinstance(t, torch.Tensor) and tuple(t.shape) == shape and _dense(t)
                and self.kernel.stores[k].domain == "vec"]  # one value per row is written contiguously
        if like:
            return torch.empty_like(like[0], dtype=dtype)
        device = next(t.device for t in inputs if isinstance(t, torch.Tensor))
        return torch.empty(shape, dtype=dtype, device=device)

    def run_backward(self, inputs: tuple, grads: tuple, needs: tuple[bool, ...]) -> list:
        tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
        wanted = {i for i, need in enumerate(needs) if need}
        generated = {load.input for load in self.kernel.loads if load.grad} if self.kernel else set()
        backend = kernel_backend(tensors) if self.kernel is not None else None
        if backend is None or not wanted <= generated:
            return self._eager_backward(inputs, grads, needs)
        module = load_kernel(self.kernel)
        launch = _Launch(self.kernel, inputs, self._row_shape(inputs))
        device = tensors[0].device
        gouts = [g.contiguous() if g is not None else torch.zeros(self.out_shapes[k], device=device)
                 for k, g in enumerate(grads)]
        indexed = [(i, load) for i, load in enumerate(self.kernel.loads) if load.grad]
        broadcast = any(inputs[load.input].numel() < math.prod(_row_shape(launch.lead, launch.length, load.domain))
                        for _, load in indexed)
        programs = accumulating_programs(device, launch.rows) if broadcast else max(launch.rows, 1)
        compute = getattr(torch, self.kernel.compute_dtype)
        buffers = [_GradBuffer.make(inputs[load.input], load, launch, programs, compute) for _, load in indexed]
        launch.run(getattr(module, self.kernel.backward_name), gouts + [a for b in buffers for a in b.args],
                   programs=programs, flags={f"ACC{i}": b.accumulate for (i, _), b in zip(indexed, buffers)})
        self.launches["backward"] += 1
        out: list = [None] * len(inputs)
        for (_, load), buffer in zip(indexed, buffers):
            g = buffer.result()
            out[load.input] = g if out[load.input] is None else out[load.input] + g
        return [g if i in wanted else None for i, g in enumerate(out)]

    def _eager_backward(self, inputs: tuple, grads: tuple, needs: tuple[bool, ...]) -> list:
        """Recompute the region's eager ops under autograd and differentiate them."""
        detached = [t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) else t
                    for t, need in zip(inputs, needs)]
        with torch.enable_grad():
            outs = tuple(self.eager(*detached))
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wrt = [t for t, need in zip(detached, needs) if need]
        if not pairs or not wrt:
            return [None] * len(inputs)
        found = iter(torch.autograd.grad([o for o, _ in pairs], wrt, [g for _, g in pairs], allow_unused=True))
        return [next(found) if need else None for need in needs]

    def _row_shape(self, inputs) -> tuple[int, ...]:
        return self.row_shape

    def _out_dtypes(self, inputs) -> list[torch.dtype]:
        """The float inputs' promoted dtype (bf16 in, bf16 out), as the eager ops would give."""
        dtype = None
        for t in inputs:
            if isinstance(t, torch.Tensor) and t.dtype.is_floating_point:
                dtype = t.dtype if dtype is None else torch.promote_types(dtype, t.dtype)
        return [dtype or torch.float32] * len(self.out_shapes)


class _FusedFunction(torch.autograd.Function):
    """Saves the region's inputs only; backward by the generated kernel or eager recompute."""

    @staticmethod
    def forward(ctx, region: FusedRegion, *inputs):
        ctx.region = region
        ctx.save_for_backward(*[t if isinstance(t, torch.Tensor) else None for t in inputs])
        ctx.others = [None if isinstance(t, torch.Tensor) else t for t in inputs]
        return region.run_forward(inputs)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs = tuple(s if o is None else o for s, o in zip(saved, ctx.others))
        needs = tuple(ctx.needs_input_grad[1:])
        return (None, *ctx.region.run_backward(inputs, grads, needs))
