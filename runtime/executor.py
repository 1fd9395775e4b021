"""The per-rank executor: runs one rank's compiled program for forward, backward and the update.

It receives plain values from the compiler (the program's graph, the layout of every state
tensor and input, the axes to reduce) and never re-plans. The same executor runs under torchrun
(one process per rank, torch.distributed groups) and in the simulator (one thread per rank,
in-memory collectives): only the Mesh it is given differs.
"""

from __future__ import annotations

import contextlib
import copy
import math
import weakref
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx

from .layout import gather_full, local_chunk, zigzag_permute
from .moe import rank_stats
from .pipeline import PipelineMixin, held_inputs
from .random import set_random_keys
from .reducer import GradReducer
from .timeline import Timeline
from .checkpoint import CheckpointError
from .errors import NonFiniteLoss
from .recompute import observe_kept
from .reducer import pad_to_multiple
from .replica_guard import ReplicaGuard
from .state_write import StateWrite, apply_writes
from .zero import ZeroOptimizer
from .zero3 import ZeroFetch, ZeroGather, Zero3Registry, shard_of, unshard

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def build_optimizer(factory: OptimizerFactory, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The user's optimizer over ``params``. A rank with nothing to train (a pipeline stage of frozen
    layers, fine-tuning) still gets one, over an empty placeholder that never has a gradient:
    its step does nothing, and its param_groups keep the user's hyperparameters for checkpoints."""
    return factory(params if params else [torch.nn.Parameter(torch.zeros(0))])


def bind_graph(gm: fx.GraphModule, mesh) -> fx.GraphModule:
    """A rank's copy of the program: its own collective modules bound to its mesh, graph shared."""
    modules = {}
    for name, module in gm.named_children():
        mine = copy.deepcopy(module)
        for part in mine.modules():  # pipeline stages nest their collectives one level down
            if hasattr(part, "bind") and not isinstance(part, fx.GraphModule):
                part.bind(mesh)
        modules[name] = mine
    return fx.GraphModule(modules, gm.graph, class_name="RankProgram")


class RankExecutor:
    """One rank: local shards of the state, the bound program, the optimizer and the grad reducer."""

    def __init__(self, program, mesh, full_state: Mapping[str, torch.Tensor], *,
                 optimizer: OptimizerFactory | None = None, bucket_bytes: int = 25 * 2**20,
                 zero: int = 0, microbatches: int = 1, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, replica_check: int = 0) -> None:
        self.program, self.mesh = program, mesh
        self.gm = bind_graph(program.gm, mesh)
        self.pending_writes: dict[str, torch.Tensor] = {}  # buffers the forward wrote (StateWrite)
        for module in self.gm.modules():
            if isinstance(module, StateWrite):
                module.pending = self.pending_writes
        self.microbatches, self.compute_dtype = microbatches, compute_dtype
        self.zero3 = Zero3Registry() if any(s.zero3 for s in program.state) else None
        for module in self.gm.modules():
            if isinstance(module, (ZeroFetch, ZeroGather)):
                module.registry = self.zero3
        self.state: dict[str, torch.Tensor] = {}
        self.params: list[torch.nn.Parameter] = []
        for spec in program.state:
            if self._holds(spec):
                self.state[spec.placeholder] = self._local_state(spec, full_state[spec.name])
        # ZeRO-3 slices get their dp sum from the graph's reduce-scatter; other axes stay here
        entries = [(s.name, self.state[s.placeholder], tuple(a for a in s.grad_axes if not (s.zero3 and a == "dp")))
                   for s in program.state
                   if s.placeholder in self.state and isinstance(self.state[s.placeholder], torch.nn.Parameter)]
        self.timeline: Timeline | None = None
        sharded = zero in (1, 2) and mesh.size("dp") > 1
        self.reducer = GradReducer(entries, mesh, bucket_bytes=bucket_bytes,
                                   scatter_axis="dp" if sharded and zero >= 2 else None, wire_dtype=reduce_dtype)
        factory = optimizer or default_optimizer
        self.optimizer = ZeroOptimizer(self.reducer, "dp", zero, factory, self.params, build_optimizer) \
            if sharded else build_optimizer(factory, self.params)
        self._order = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.guard = ReplicaGuard(program, mesh, self.state, replica_check) if replica_check else None

    def _holds(self, spec) -> bool:
        """Whether this rank keeps a state tensor (a pipeline rank keeps only its stages')."""
        return True

    def _held_or_zeros(self, spec) -> torch.Tensor:
        """This rank's tensor of a state entry, or zeros of its local shape where another rank holds it."""
        if spec.placeholder in self.state:
            return self.state[spec.placeholder].detach()
        local = spec.layout.local_shape(spec.global_shape, self.program.mesh)
        return torch.zeros(local, dtype=spec.dtype, device=self.mesh.device)

    def _local_state(self, spec, full: torch.Tensor) -> torch.Tensor:
        local = local_chunk(full.detach(), spec.layout.placements, self.mesh.shape, self.mesh.coord).clone()
        if spec.zero3:
            local = shard_of(local, self.mesh.comm("dp"))
        if spec.kind == "param" and full.requires_grad:
            param = torch.nn.Parameter(local)
            self.params.append(param)
            return param
        return local

    def _arguments(self, batch: tuple) -> list[torch.Tensor]:
        values = {name: self._compute(t) for name, t in self.state.items()}
        for spec, value in zip(self.program.inputs, batch):
            values[spec.placeholder] = self._compute(self._local_input(spec, value))
        return [values[name] for name in self._order]

    def _compute(self, t):
        """dtype=bf16: float tensors enter the graph in bfloat16 (a differentiable cast, so the
        float32 master weights receive float32 gradients)."""
        if self.compute_dtype is None or not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point:
            return t
        return t.to(self.compute_dtype)

    def _split(self, batch: tuple) -> list[tuple]:
        """The global batch as `microbatches` global microbatches along dim 0."""
        if len(batch) != len(self.program.inputs):
            raise TypeError(f"the compiled model takes {len(self.program.inputs)} inputs "
                            f"({', '.join(i.placeholder for i in self.program.inputs)}); got {len(batch)}")
        if self.microbatches == 1:
            return [batch]
        pieces = [v.chunk(self.microbatches, 0) if isinstance(v, torch.Tensor) else [v] * self.microbatches
                  for v in batch]
        return [tuple(p[m] for p in pieces) for m in range(self.microbatches)]

    def _local_input(self, spec, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            return value
        if tuple(value.shape) != spec.global_shape:
            raise ValueError(f"input '{spec.placeholder}' has shape {list(value.shape)} but the model was compiled "
                             f"for {list(spec.global_shape)}; pass the same global batch shape on every step "
                             "(compile again for another shape)")
        for axis, placement in zip(self.program.mesh.axes, spec.layout.placements):
            if axis in self.program.mesh.zigzag and hasattr(placement, "dim"):
                value = zigzag_permute(value, placement.dim, self.mesh.size(axis))
        return local_chunk(value, spec.layout.placements, self.mesh.shape, self.mesh.coord)

    def _loss(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor | float]:
        """(loss, count): count is the global number of tokens the loss averaged over when the
        program exposes it (a mean cross-entropy), else 1."""
        with self._saved_tensor_hooks():
            out = self.gm(*self._arguments(batch))
        if not isinstance(out, (tuple, list)):
            return out, 1.0
        return (out[0], out[1].detach().to(torch.float64)) if len(out) > 1 else (out[0], 1.0)

    _measure = None  # set by activation_bytes: sees every tensor autograd saves

    def _saved_tensor_hooks(self):
        """ZeRO-3 drops saved gathered parameters (re-gathered in backward); activation_bytes
        counts what is saved. One hook pair does both: only the innermost pair would run."""
        if self.zero3 is None and self._measure is None:
            return contextlib.nullcontext()
        measure, zero3 = self._measure, self.zero3

        def pack(t):
            packed = zero3.pack(t) if zero3 is not None else t
            if measure is not None and packed is t:  # a re-gatherable parameter is not an activation
                measure(t)
            return packed

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, Zero3Registry.unpack)
        if measure is None:
            return hooks
        both = contextlib.ExitStack()  # selective recompute keeps matmul outputs past the hooks
        both.enter_context(hooks)
        both.enter_context(observe_kept(measure))
        return both

    def _global(self, loss: torch.Tensor) -> float:
        value = loss.detach()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.float()
        for axis in self.program.loss_partial_axes:
            value = self.mesh.comm(axis).all_reduce(value)
        return float(value)

    def set_timeline(self, timeline: Timeline | None) -> None:
        self.timeline = timeline
        self.mesh.set_timeline(timeline)

    def _span(self, name: str):
        if self.timeline is None:
            return _nothing()
        return self.timeline.span(name, "compute")

    def step(self, batch: tuple) -> float:
        """One optimizer step on the global batch; returns the global mean loss.

        With microbatches the loss is the global token mean, not a mean of microbatch means:
        microbatch m contributes sum_m / N where N is the total count, so each backward is scaled
        by count_m / N once N is known (after the last forward); the gradient reduction runs
        once, during the last microbatch's backward."""
        micro = self._split(batch)
        for module in self.gm.modules():
            if hasattr(module, "reset_stats"):  # per-step statistics (MoE loads)
                module.reset_stats()
        count, weighted = 0.0, []
        for m, piece in enumerate(micro):
            last = m == len(micro) - 1
            self._key_random(self.gm, m)
            with self._span("forward"):
                loss, n = self._loss(piece)
            count += float(n)
            if last:
                self._scale_grads(1.0 / count if len(micro) > 1 else 1.0)
            scale = float(n) / count if last else float(n)
            weighted.append(loss.detach() * float(n))
            with self._span("backward"), (contextlib.nullcontext() if last else self.reducer.no_sync()):
                (loss * scale).backward() if scale != 1.0 else loss.backward()
        self.reducer.finish()
        self.peak_state_bytes = self.memory_bytes()  # gradients are at their peak here
        value = self._global(sum(weighted) / count)
        self._check_finite(value)
        with self._span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.reducer.attach_grad_views()
        self._write_buffers()
        return value

    def _write_buffers(self) -> None:
        """Buffers take what the step's forward wrote to them (after every microbatch has read them);
        then the replica guard (plan option replica_check=N) compares replicated state with peers."""
        apply_writes(self.pending_writes, self.state)
        if self.guard is not None:
            self.guard.after_step(self.steps_done)

    steps_done = 0

    def _key_random(self, module: torch.nn.Module, microbatch: int) -> None:
        """Random draws are keyed by (seed, step, microbatch): see runtime/random.py."""
        set_random_keys(module, step=self.steps_done, microbatch=microbatch)

    def _check_finite(self, value: float) -> None:
        """Every rank sees the same global loss, so all of them stop together (no hang)."""
        self.steps_done += 1
        if not math.isfinite(value):
            self.optimizer.zero_grad(set_to_none=True)
            self.reducer.attach_grad_views()
            raise NonFiniteLoss(self.steps_done, self.mesh.rank, value)

    def _scale_grads(self, factor: float) -> None:
        if factor == 1.0:
            return
        grads = [param.grad for param in self.params if param.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)  # one dispatch for every gradient

    def activation_bytes(self, batch: tuple) -> int:
        """Bytes of the activations autograd saves for backward in one forward (unique storages,
        parameters excluded): the activation memory a step holds at its peak, measured.
        A storage freed before forward ends (a recompute region whose graph kept nothing) no
        longer counts, and its address may be reused by another."""
        params = {p.untyped_storage()._cdata for p in self.params}  # _cdata: also unique for fake tensors
        seen: dict[int, tuple[int, object]] = {}

        def measure(t: torch.Tensor) -> None:
            storage = t.untyped_storage()
            key = storage._cdata
            if key not in params and key not in seen:
                token = object()
                seen[key] = (storage.nbytes(), token)
                weakref.finalize(storage, _forget, seen, key, token)

        self._measure = measure
        try:
            loss, _ = self._loss(self._split(batch)[0])
        finally:
            self._measure = None
        total = sum(nbytes for nbytes, _ in seen.values())
        del loss
        return total

    @torch.no_grad()
    def evaluate(self, batch: tuple) -> float:
        pieces = []
        for m, piece in enumerate(self._split(batch)):
            self._key_random(self.gm, m)
            pieces.append(self._loss(piece))
        self.pending_writes.clear()  # evaluation updates nothing
        count = sum(float(n) for _, n in pieces)
        return self._global(sum(loss * float(n) for loss, n in pieces) / count)

    # ------------------------------------------------------------------ checkpoints (full tensors)
    def _named_params(self) -> dict[str, tuple]:
        """The parameters this rank holds, by name."""
        return {spec.name: (spec, self.state[spec.placeholder]) for spec in self.program.state
                if isinstance(self.state.get(spec.placeholder), torch.nn.Parameter)}

    def _owned(self, spec, value: torch.Tensor) -> torch.Tensor:
        return value  # pipeline ranks take the owning stage's copy (PipelineMixin)

    def _dp_whole(self, spec, value: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's local tensor of a state entry (a ZeRO-3 slice gathered back over dp)."""
        value = self._owned(spec, self._held_or_zeros(spec) if value is None else value)
        if not spec.zero3:
            return value
        return unshard(value, spec.layout.local_shape(spec.global_shape, self.program.mesh), self.mesh.comm("dp"))

    def _local_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Optimizer state per parameter name, shaped like this rank's parameter (ZeRO slices
        are gathered over dp and cut back into parameters)."""
        by_param = {id(p): name for name, (_, p) in self._named_params().items()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        inner = self.optimizer.inner if isinstance(self.optimizer, ZeroOptimizer) else self.optimizer
        for param, state in inner.state.items():
            if id(param) in by_param:
                out[by_param[id(param)]] = dict(state)
        if isinstance(self.optimizer, ZeroOptimizer):
            for bucket, master in zip(self.optimizer.buckets, self.optimizer.masters):
                for key, value in inner.state.get(master, {}).items():
                    full = self.optimizer.comm.all_gather(value, 0) if value.dim() else value
                    offset = 0
                    for name, p in bucket.params:
                        piece = full[offset: offset + p.numel()].view_as(p) if value.dim() else value
                        out.setdefault(name, {})[key] = piece
                        offset += p.numel()
        return out

    def _optimizer_entries(self) -> list[tuple]:
        """(spec, key, this rank's tensor) of every optimizer state entry, in one order all ranks share."""
        params = self._named_params()
        return [(params[name][0], key, value) for name, state in sorted(self._local_optimizer_state().items())
                for key, value in state.items()]

    def checkpoint_state(self) -> tuple[dict[str, torch.Tensor], dict]:
        """Full tensors for a checkpoint: 'model/<name>' and 'optim/<name>/<key>' (a collective call)."""
        tensors = {}
        for spec in self.program.state:
            tensors[f"model/{spec.name}"] = gather_full(self._dp_whole(spec), spec.layout.placements, self.mesh)
        for spec, key, value in self._optimizer_entries():
            full = gather_full(self._dp_whole(spec, value), spec.layout.placements, self.mesh) \
                if value.dim() else value
            tensors[f"optim/{spec.name}/{key}"] = full
        inner = self.optimizer.inner if isinstance(self.optimizer, ZeroOptimizer) else self.optimizer
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None),
                                                                                  list, tuple))}
                  for g in inner.param_groups]
        return tensors, {"param_groups": groups}

    def load_checkpoint_state(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        """Take this rank's shards of a full checkpoint (any plan wrote it)."""
        for spec in self.program.state:
            full = tensors.get(f"model/{spec.name}")
            if full is None:
                raise CheckpointError(f"the checkpoint has no tensor for '{spec.name}'")
            if tuple(full.shape) != spec.global_shape:
                raise CheckpointError(f"'{spec.name}' is {list(full.shape)} in the checkpoint but "
                                      f"{list(spec.global_shape)} in the model")
            if spec.placeholder not in self.state:
                continue
            local = local_chunk(full, spec.layout.placements, self.mesh.shape, self.mesh.coord)
            if spec.zero3:
                local = shard_of(local, self.mesh.comm("dp"))
            with torch.no_grad():
                self.state[spec.placeholder].copy_(local)
        local_state: dict[str, dict[str, torch.Tensor]] = {}
        params = self._named_params()
        for key, full in tensors.items():
            if key.startswith("optim/"):
                name, field = key[len("optim/"):].rsplit("/", 1)
                if name not in params:
                    continue  # another pipeline rank holds it
                spec = params[name][0]
                local = local_chunk(full, spec.layout.placements, self.mesh.shape, self.mesh.coord) \
                    if full.dim() else full
                if spec.zero3 and full.dim():
                    local = shard_of(local, self.mesh.comm("dp"))
                local_state.setdefault(name, {})[field] = local.clone()
        self._set_optimizer_state(local_state)
        inner = self.optimizer.inner if isinstance(self.optimizer, ZeroOptimizer) else self.optimizer
        for group, saved in zip(inner.param_groups, meta.get("param_groups", [])):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})

    def _set_optimizer_state(self, local_state: dict[str, dict[str, torch.Tensor]]) -> None:
        params = self._named_params()
        if not isinstance(self.optimizer, ZeroOptimizer):
            for name, state in local_state.items():
                self.optimizer.state[params[name][1]] = state
            return
        inner, zero = self.optimizer.inner, self.optimizer
        in_bucket = set()
        for bucket, master in zip(zero.buckets, zero.masters):
            names = [n for n, _ in bucket.params]
            in_bucket.update(names)
            keys = set().union(*(local_state.get(n, {}).keys() for n in names))
            state = {}
            for key in keys:
                values = [local_state[n][key] for n in names]
                if values[0].dim() == 0:
                    state[key] = values[0]
                    continue
                flat = pad_to_multiple(torch.cat([v.reshape(-1) for v in values]), zero.comm.size)
                size = flat.numel() // zero.comm.size
                state[key] = flat[zero.comm.rank * size: (zero.comm.rank + 1) * size].clone()
            if state:
                inner.state[master] = state
        for name, state in local_state.items():
            if name not in in_bucket:
                inner.state[params[name][1]] = state

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now in parameters, gradients and optimizer state (unique storages)."""
        def nbytes(tensors) -> int:
            seen = {}
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return sum(seen.values())

        grads = [p.grad for p in self.params] + [b.shard_grad for b in self.reducer.buckets]
        if isinstance(self.optimizer, ZeroOptimizer):
            grads += [m.grad for m in self.optimizer.masters]
            states = self.optimizer.inner.state.values()
        else:
            states = self.optimizer.state.values()
        return {"params": nbytes(self.params), "grads": nbytes(grads),
                "optimizer": nbytes(t for state in states for t in state.values())}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded state under every state_dict name (tied weights appear under each name)."""
        out = {}
        for spec in self.program.state:
            full = gather_full(self._dp_whole(spec), spec.layout.placements, self.mesh)
            for name in spec.aliases:
                out[name] = full
        return out

    def moe_stats(self) -> dict[str, dict]:
        """This rank's MoE loads and all-to-all bytes of the last step (``runtime.moe.rank_stats``)."""
        return rank_stats(self.gm, self.mesh)

    def local_state(self) -> dict[str, torch.Tensor]:
        """The state tensors this rank holds (a pipeline rank: its stages')."""
        return {spec.name: self.state[spec.placeholder].detach() for spec in self.program.state
                if spec.placeholder in self.state}


def _forget(seen: dict, key: int, token: object) -> None:
    if key in seen and seen[key][1] is token:
        del seen[key]


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def traced_device(gm) -> torch.device:
    """The device a program was traced on, as its factory ops name it (``arange(device=...)``): a
    model built on ``meta`` bakes ``meta`` into them, so its fake run must hold meta tensors too."""
    for node in gm.graph.nodes:
        device = node.kwargs.get("device") if node.op == "call_function" else None
        if isinstance(device, torch.device) and device.type == "meta":
            return device
    return torch.device("cpu")


@contextlib.contextmanager
def fake_rank_zero(program, **options):
    """Rank 0 of ``program`` on fake tensors with peerless collectives (ShapeComm), and a batch of
    its input shapes: no memory, no processes, any mesh size. Yields (executor, batch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .comm import ShapeComm
    from .mesh import Mesh

    device = traced_device(program.gm)
    mesh = Mesh(program.mesh.axes, program.mesh.shape, 0, device,
                {a: ShapeComm(a, n) for a, n in zip(program.mesh.axes, program.mesh.shape)})
    with FakeTensorMode(allow_non_fake_inputs=True):
        state = {}
        for spec in program.state:
            tensor = torch.zeros(spec.global_shape, dtype=spec.dtype, device=device)
            state[spec.name] = torch.nn.Parameter(tensor) if spec.kind == "param" and spec.trainable else tensor
        batch = tuple(torch.zeros(spec.global_shape, dtype=spec.dtype, device=device) for spec in program.inputs)
        yield RankExecutor(program, mesh, state, microbatches=1, **options), batch


def estimate_activation_bytes(program, **options) -> int:
    """Activation bytes rank 0 saves for backward in one forward, found by running its program on
    fake tensors with peerless collectives (ShapeComm): no memory, no processes, any mesh size."""
    with fake_rank_zero(program, **options) as (rank, batch):
        return rank.activation_bytes(batch)


class PipelineExecutor(PipelineMixin, RankExecutor):
    """A pp rank: runs its stage of the program over microbatches in schedule order."""

    def __init__(self, program, mesh, full_state, *, schedule, **options) -> None:
        self._held = held_inputs(program.gm, schedule.pp, mesh.coord_of("pp"))
        RankExecutor.__init__(self, program, mesh, full_state, **options)
        self._setup_pipeline(schedule)
