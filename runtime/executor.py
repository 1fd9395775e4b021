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
import operator
import weakref
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from .graph_code import generate_code
from .layout import gather_full, local_chunk, local_shape, zigzag_permute
from .moe import rank_stats
from .optimizer_contract import check_optimizer
from .pipeline import PipelineMixin, deferred_inputs, held_inputs
from .random import set_random_keys
from .reducer import GradReducer
from .timeline import Timeline
from .checkpoint_state import ShardedCheckpoint
from .errors import NonFiniteLoss
from .vocab import saw_index_no_rank_holds
from .loss_value import StepDivisor, loss_parts, microbatch_share, step_count
from .input_checks import BadInput, check_dtypes, check_ranges, index_uses, shard_view
from .recompute import observe_kept
from .replica_guard import ReplicaGuard
from .state_write import StateWrite, apply_writes
from .zero import ZeroOptimizer
from .zero3 import ZeroFetch, ZeroGather, Zero3Registry, shard_of, unshard
from .training import bucket_groups, data_local, GradPiece, NamedParameters, clip_, counted_once, global_norm, slice_pieces

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def build_optimizer(factory: OptimizerFactory, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The user's optimizer over ``params``. A rank with nothing to train (a pipeline stage of frozen
    layers, fine-tuning) still gets one, over an empty placeholder that never has a gradient:
    its step does nothing, and its param_groups keep the user's hyperparameters for checkpoints."""
    return factory(params if params else NamedParameters([torch.nn.Parameter(torch.zeros(0))], [()]))


def bind_graph(gm: fx.GraphModule, mesh, *, share_code: bool = True) -> fx.GraphModule:
    """A rank's copy of the program: its own collective modules bound to its mesh, graph shared
    (copied when its factory calls must move to the mesh's device). A pipeline's stages are rank
    copies of their own, one level down. ``share_code``: generate the graph's Python now, once for
    every copy; without, a lazy graph's Python waits for the first call of any copy (the class is
    shared), and a program only run node by node (the planner's fake runs, under torch.fx's
    Interpreter) never has it generated."""
    return _rank_copy(gm, mesh, {}, "RankProgram", share_code)


def _rank_copy(gm: fx.GraphModule, mesh, memo: dict, class_name: str, share_code: bool) -> fx.GraphModule:
    children = {}
    for name, module in gm.named_children():
        if isinstance(module, fx.GraphModule):
            children[name] = _rank_copy(module, mesh, memo, type(module).__name__, share_code)
            continue
        mine = copy.deepcopy(module, memo)  # one memo a rank: a module two stages share stays shared
        for part in mine.modules():  # a recompute region holds its graph inside a module
            if hasattr(part, "bind") and not isinstance(part, fx.GraphModule):
                part.bind(mesh)
            elif isinstance(part, fx.GraphModule) and _move_factories(part.graph, mesh.device):
                part.recompile()
        children[name] = mine
    if _factory_devices(gm.graph, mesh.device):
        graph = copy.deepcopy(gm.graph)
        _move_factories(graph, mesh.device)
        # the attributes the graph reads beside the children (a constant kept on the module)
        attrs = {n.target: operator.attrgetter(n.target)(gm) for n in graph.nodes
                 if n.op == "get_attr" and n.target.split(".")[0] not in children}
        return fx.GraphModule({**children, **attrs}, graph, class_name=class_name)
    return _sharing_code(gm, children, share_code)


def _sharing_code(gm: fx.GraphModule, children: dict, share_code: bool = True) -> fx.GraphModule:
    """A module running ``gm``'s graph over ``children``: an instance of ``gm``'s own class, whose
    generated ``forward`` reads submodules by name, so every rank shares the Python torch.fx
    generated for the graph once (generating it is most of the cost of a copy)."""
    if share_code:
        generate_code(gm)
    shell = object.__new__(type(gm))
    shell.__dict__.update({k: v.copy() if isinstance(v, (dict, set, list)) else v for k, v in gm.__dict__.items()})
    shell._modules.clear()
    shell._modules.update(children)
    return shell


def _factory_devices(graph: fx.Graph, device: torch.device) -> list[fx.Node]:
    """Nodes that create a tensor on another device than `device`: torch.export bakes the tracing
    device into factory calls (arange, zeros, full, ...) and into moves (``aten.to.device(x, dev)``,
    from ``x.to(y.device)``: ``meta`` for a model built there), and the program runs on the mesh's."""
    return [n for n in graph.nodes if n.op == "call_function"
            and any(_other_device(v, device) for v in (*n.args, n.kwargs.get("device")))]


def _other_device(value, device: torch.device) -> bool:
    return isinstance(value, torch.device) and value != device


def _move_factories(graph: fx.Graph, device: torch.device) -> bool:
    nodes = _factory_devices(graph, device)
    for node in nodes:
        node.args = tuple(device if _other_device(a, device) else a for a in node.args)
        if _other_device(node.kwargs.get("device"), device):
            node.kwargs = {**node.kwargs, "device": device}
    return bool(nodes)


class RankExecutor(ShardedCheckpoint):
    """One rank: local shards of the state, the bound program, the optimizer and the grad reducer."""

    _deferred: frozenset = frozenset()  # inputs whose dp sum waits for the step's end (pipelines set it)
    _share_code = True  # bind_graph's: generate the program's Python once, at bind

    def __init__(self, program, mesh, full_state: Mapping[str, torch.Tensor], *,
                 optimizer: OptimizerFactory | None = None, bucket_bytes: int = 25 * 2**20,
                 zero: int = 0, microbatches: int = 1, compute_dtype: torch.dtype | None = None,
                 reduce_dtype: torch.dtype | None = None, replica_check: int = 0) -> None:
        self.program, self.mesh = program, mesh
        self.gm = bind_graph(program.gm, mesh, share_code=self._share_code)
        # a loss dividing by the step's count: the program that counts, bound like the step's
        counts = program.step_counts
        self._count_program = bind_graph(counts.program, mesh, share_code=self._share_code) \
            if counts is not None else None
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
        self._param_names: dict[int, str] = {}
        for spec in program.state:
            if self._holds(spec):
                self.state[spec.placeholder] = self._local_state(spec, full_state[spec.name])
        # ZeRO-3 slices get their dp sum from the graph's reduce-scatter; other axes stay here
        entries = [(s.name, self.state[s.placeholder], tuple(a for a in s.grad_axes if not (s.zero3 and a == "dp")))
                   for s in program.state
                   if s.placeholder in self.state and isinstance(self.state[s.placeholder], torch.nn.Parameter)]
        self.timeline: Timeline | None = None
        sharded = zero in (1, 2) and mesh.size("dp") > 1
        factory = optimizer or default_optimizer
        self.reducer = GradReducer(entries, mesh, bucket_bytes=bucket_bytes,
                                   scatter_axis="dp" if sharded else None,
                                   scatter_each=sharded and zero >= 2, wire_dtype=reduce_dtype,
                                   group_of=self._group_of(factory),
                                   deferred={s.name for s in program.state if s.placeholder in self._deferred})
        named = NamedParameters(self.params, [(self._param_names[id(p)],) for p in self.params])
        self.optimizer = ZeroOptimizer(self.reducer, "dp", factory, named, build_optimizer, compute_dtype) \
            if sharded else build_optimizer(factory, named)
        check_optimizer(self.optimizer.inner if sharded else self.optimizer, self._split_params(sharded, zero))
        self._order = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]
        self.guard = ReplicaGuard(program, mesh, self.state, replica_check, self._agreed_dtype) \
            if replica_check else None

    def _agreed_dtype(self, placeholder: str) -> torch.dtype | None:
        """ZeRO-1/2 gathered the updated slices in the compute dtype: dp copies agree in it."""
        if not isinstance(self.optimizer, ZeroOptimizer):
            return None
        return self.optimizer.agreed_dtype(self.state[placeholder])

    def _group_of(self, factory) -> Callable[[str], int] | None:
        """A grouping factory's group of each state entry, by the name named_parameters() gives it."""
        return bucket_groups(factory, self.program.state)

    def _split_params(self, sharded: bool, zero: int) -> dict[str, str]:
        """Trainable parameters this rank's optimizer sees only a slice of, and the plan axes why."""
        mesh = self.program.mesh
        out = {}
        for spec in self.program.state:
            if spec.kind != "param" or not spec.trainable:
                continue
            axes = [f"{a}={mesh.size(a)}" for a, p in zip(mesh.axes, spec.layout.placements)
                    if isinstance(p, Shard)]
            if spec.zero3 or sharded:
                axes.append(f"zero={zero} dp={mesh.size('dp')}")
            if axes:
                out[spec.name] = " ".join(axes)
        return out

    def _holds(self, spec) -> bool:
        """Whether this rank keeps a state tensor (a pipeline rank keeps only its stages')."""
        return True

    def _held_or_zeros(self, spec) -> torch.Tensor:
        """This rank's tensor of a state entry, or zeros of its local shape where another rank holds it."""
        if spec.placeholder in self.state:
            return self.state[spec.placeholder].detach()
        local = spec.layout.local_shape(spec.global_shape, self.program.mesh)
        return torch.zeros(local, dtype=spec.dtype, device=self.mesh.device)

    @property
    def device(self) -> torch.device:
        """The program's device (the mesh's): state, batches and every tensor the runtime makes."""
        return self.mesh.device

    def _local_piece(self, spec, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of a state entry on the device: cut first, then moved, so only this
        rank's slice ever reaches the device."""
        return _to_device(local_chunk(full.detach(), spec.layout.placements, self.mesh.shape, self.mesh.coord),
                          self.device)

    def _local_state(self, spec, full: torch.Tensor) -> torch.Tensor:
        local = self._local_piece(spec, full)
        if spec.zero3:
            local = shard_of(local, self.mesh.comm("dp"))
        if spec.kind == "param" and full.requires_grad:
            param = torch.nn.Parameter(local)
            self.params.append(param)
            self._param_names[id(param)] = spec.aliases[0] if spec.aliases else spec.name  # named_parameters' name
            return param
        return local

    _cast: dict | None = None  # inside a step: the state in the compute dtype, cast once (see _state_values)

    @contextlib.contextmanager
    def _state_cast_once(self):
        """For one step (or evaluation): every microbatch's forward takes the same compute-dtype copy
        of the state. A copy per microbatch would hold one per microbatch in flight -- a pipeline's
        first rank p copies of its stage's weights under 1F1B. The parameters do not change inside a
        step (the optimizer runs after it), and the cast's backward saves nothing, so each
        microbatch's backward passes through the one cast."""
        self._cast = {}
        try:
            yield
        finally:
            self._cast = None

    def _state_values(self) -> dict[str, torch.Tensor]:
        """The state as the graph takes it: float tensors in the compute dtype (bf16 plans)."""
        if self._cast is None:  # outside a step: cast afresh
            return {name: self._compute(t) for name, t in self.state.items()}
        if len(self._cast) != len(self.state):
            self._cast.update({name: self._compute(t) for name, t in self.state.items()})
        return dict(self._cast)

    def _arguments(self, batch: tuple) -> list[torch.Tensor]:
        values = self._input_values(batch)
        return [values[name] for name in self._order]

    def _input_values(self, piece: tuple, only: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
        """The program's inputs by placeholder: the state, and this rank's part of the batch ``piece``
        (``only``: just these placeholders, the state not cast)."""
        if only is None:
            values = self._state_values()
        else:
            values = {name: self._compute(self.state[name]) for name in only if name in self.state}
        for spec, value in zip(self.program.inputs, piece):
            if only is None or spec.placeholder in only:
                values[spec.placeholder] = self._compute(self._local_input(spec, value))
        return values

    _step_tokens: torch.Tensor | None = None  # the last step's counts (a loss dividing by the step's count)

    def _set_step_divisors(self, micro: list[tuple]) -> None:
        """A loss whose token means divide by the step's count (``Program.step_counts``): sum each
        count's local part over the microbatches, then over its mesh axes (one float64 all-reduce per
        axis), and set each token mean's divisor to that count / M -- before the first forward, so
        every microbatch's backward carries its exact share. Runs no model."""
        counts = self.program.step_counts
        if counts is None:
            return
        with torch.no_grad():
            totals = None
            for piece in micro:
                values = self._input_values(piece, only=counts.reads)
                local = self._count_program(*[values[name] for name in counts.reads])
                local = [torch.as_tensor(v).to(device=self.device, dtype=torch.float64) for v in local]
                totals = local if totals is None else [t + v for t, v in zip(totals, local)]
            for axes, members in counts.groups():  # one float64 vector per group of counts, per axis
                part = torch.stack([totals[i] for i in members])
                for axis in axes:
                    if self.mesh.size(axis) > 1:
                        part = self.mesh.comm(axis).all_reduce(part)
                for i, value in zip(members, part.unbind()):
                    totals[i] = value
            totals = torch.stack(totals)
        self._step_tokens = totals
        divisors = counts.divisors(totals, len(micro))
        for module in self.gm.modules():
            if isinstance(module, StepDivisor):
                module.value = divisors[module.index].to(module.dtype)

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
        # a 0-d tensor (a count the batch carries, transformers' num_items_in_batch) is every microbatch's
        pieces = [v.chunk(self.microbatches, 0) if isinstance(v, torch.Tensor) and v.dim() else [v] * self.microbatches
                  for v in batch]
        return [tuple(p[m] for p in pieces) for m in range(self.microbatches)]

    local_batch = False  # set per call: the batch is this rank's data shard (usc.data), not the global batch

    def _local_input(self, spec, value) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            return value
        placements, shape = self._check_shape(spec, value)
        value = value.to(self.device)  # the batch is small: cut and permute it where it is used
        for axis, placement in zip(self.program.mesh.axes, placements):
            if axis in self.program.mesh.zigzag and hasattr(placement, "dim"):
                value = zigzag_permute(value, placement.dim, self.mesh.size(axis))
        return local_chunk(value, placements, self.mesh.shape, self.mesh.coord)

    def _check_shape(self, spec, value: torch.Tensor) -> tuple:
        placements, shape = data_local(spec, self.program.mesh) if self.local_batch else \
            (spec.layout.placements, spec.global_shape)
        if tuple(value.shape) != shape:
            what = "this rank's data shard" if self.local_batch else "the global batch"
            name = self.input_names.get(spec.placeholder, spec.placeholder)
            short = len(shape) == value.dim() and 0 < value.shape[0] < shape[0] and tuple(value.shape[1:]) == shape[1:]
            hint = (" -- fewer rows than compiled: a data loader's last, partial batch (DataLoader(..., "
                    "drop_last=True) leaves it out)") if short else ""
            raise BadInput(f"input {name} has shape {list(value.shape)} but {what} was compiled as {list(shape)}; "
                           f"pass the same shape on every step (compile again for another){hint}",
                           input=name, value=list(value.shape), rank=self.mesh.rank)
        return placements, shape

    # ------------------------------------------------------------------ the batch, checked (input_checks.py)
    input_names: dict[str, str] = {}  # placeholder -> how the user names the input (set by usc/api.py)
    _index_uses = None

    def check_batch(self, batch: tuple) -> list[tuple]:
        """The batch's microbatches, once every input has the compiled shape and kind and every index
        lies where its op can look it up; raised before anything runs, alike on every rank."""
        micro = self._split(batch)
        rank, names = self.mesh.rank, self.input_names
        order = [spec.placeholder for spec in self.program.inputs]
        check_dtypes(self.program.inputs, batch, [names.get(n, n) for n in order], rank)
        for piece in micro:
            for spec, value in zip(self.program.inputs, piece):
                if isinstance(value, torch.Tensor):
                    self._check_shape(spec, value)
        if self._index_uses is None:
            self._index_uses = index_uses(self.program)
        if self._index_uses:
            check_ranges(self._index_uses, micro, shard_view(self.program, self.mesh, self.local_batch), names, rank)
        return micro

    def rollback(self) -> None:
        """After a failed step: drop what it left half-done (gradients, buffer writes, reductions in
        flight), so the parameters, the optimizer and the step count are as before and the next step
        starts clean. Runs no collective."""
        self.optimizer.zero_grad(set_to_none=True)
        self.reducer.reset()
        self.reducer.attach_grad_views()
        self.pending_writes.clear()
        if self.zero3 is not None:
            self.zero3.reset()

    def _loss(self, batch: tuple) -> tuple[torch.Tensor, torch.Tensor | float, torch.Tensor | None]:
        """(loss, count, empty): count is the global number of tokens the loss averaged over when the
        program exposes it (a token mean), else 1 (runtime/loss_value.py)."""
        with self._saved_tensor_hooks():
            return loss_parts(self.gm(*self._arguments(batch)))

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
        reduction = self.program.loss_value  # what the report and the cost model count as sent
        value = loss.detach().to(reduction.dtype)
        for axis in reduction.axes:
            value = self.mesh.comm(axis).all_reduce(value)
        for axis in reduction.verdict:  # the loss is a copy here: only coordinate 0's counts, but a
            mine = value if self.mesh.coord_of(axis) == 0 else value * 0  # NaN anywhere stays NaN (0 * NaN)
            value = self.mesh.comm(axis).all_reduce(mine)
        return self._to_host(value)

    def _to_host(self, value: torch.Tensor, assumed: float = 1.0) -> float:
        """A host sync: the step's one, and the rare checks. `assumed` is what a fake rank, whose
        tensors hold no data (usc/testing/fake_device.py replaces this method), takes it to be."""
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
        microbatch m's backward carries its token sum (its mean times count_m), and the reduced
        gradients are scaled by 1 / N once the step's total count N is known, as a pipeline's
        are -- on ZeRO's slices only a slice's worth. The gradient reduction runs once, during the
        last microbatch's backward (ZeRO-2 reduce-scatters in every microbatch's).
        ``peak_state_bytes``: the most parameter, gradient and optimizer bytes held at once."""
        micro = self.check_batch(batch)
        self._set_step_divisors(micro)
        for module in self.gm.modules():
            if hasattr(module, "reset_stats"):  # per-step statistics (MoE loads)
                module.reset_stats()
        # token counts stay on the device (no host sync per microbatch): the step's one sync is
        # the global loss below
        count, weighted, several = 0.0, [], len(micro) > 1
        held = None
        with self._state_cast_once():
            for m, piece in enumerate(micro):
                last = m == len(micro) - 1
                self._key_random(self.gm, m)
                with self._span("forward"):
                    loss, n, empty = self._loss(piece)
                count = count + n
                if last and several:
                    held = self.memory_bytes()  # what the earlier microbatches accumulated
                share = microbatch_share(loss, n, empty, self.program.count_transform)
                weighted.append(share.detach())
                with self._span("backward"), (contextlib.nullcontext() if last else self.reducer.no_sync()):
                    (share if several else loss).backward()
                if several and not last and self.reducer.scatters_each:
                    self.reducer.settle()  # ZeRO-2: this microbatch's slices summed before the next
        self.reducer.finish()
        count = step_count(count, self.program.count_transform)
        if several:
            self._scale_reduced(1.0 / count)
        self.peak_state_bytes = self._most(held, self.memory_bytes())
        value = self._global(sum(weighted) / count)
        self._check_finite(value, count)
        self._clip_if_asked()
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
    max_grad_norm: float | None = None  # set before a step to clip (float('inf'): measure only)
    grad_norm: float | None = None  # the last step's global gradient norm (before clipping)

    # ------------------------------------------------------------------ clipping (runtime/training.py)
    def _clip_if_asked(self) -> None:
        self.grad_norm = None
        if self.max_grad_norm is not None:
            with self._span("clip"):
                self.grad_norm = self.clip_grad_norm(self.max_grad_norm)

    def clip_grad_norm(self, max_norm: float) -> float:
        """clip_grad_norm_ over the whole model's reduced gradient (a collective on every axis);
        returns the norm before clipping."""
        pieces = self.grad_pieces()
        reduce = [self.mesh.comm(axis).all_reduce for axis in self.mesh.axes if self.mesh.size(axis) > 1]
        norm = global_norm(pieces, reduce, self.mesh.device)
        clip_(pieces, norm, max_norm)
        return norm

    def grad_pieces(self) -> list[GradPiece]:
        """Every reduced gradient this rank holds, each marked whether this rank counts it."""
        specs = {s.placeholder: s for s in self.program.state}
        pieces = [GradPiece(value.grad, self._counts(specs[name], ("dp",) if specs[name].zero3 else ()))
                  for name, value in self.state.items()
                  if isinstance(value, torch.nn.Parameter) and value.grad is not None]
        by_name = {s.name: s for s in self.program.state}
        for bucket in self.reducer.buckets:  # ZeRO-2: this rank's slice of each bucket's sum
            if bucket.shard is None or bucket.shard_grad is None:
                continue
            comm = self.mesh.comm(bucket.shard)
            for index, _, piece in slice_pieces(bucket.shard_grad, [p.numel() for _, p in bucket.params],
                                             comm.rank, comm.size):
                pieces.append(GradPiece(piece, self._counts(by_name[bucket.params[index][0]], (bucket.shard,))))
        return pieces

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer that really steps (ZeRO-1/2: the one over this rank's slices)."""
        return self.optimizer.inner if isinstance(self.optimizer, ZeroOptimizer) else self.optimizer

    def _counts(self, spec, sharded: tuple[str, ...]) -> bool:
        return counted_once(spec.layout.placements, self.mesh.axes, self.mesh.coord, sharded=sharded)

    def _key_random(self, module: torch.nn.Module, microbatch: int) -> None:
        """Random draws are keyed by (seed, step, microbatch): see runtime/random.py."""
        set_random_keys(module, step=self.steps_done, microbatch=microbatch)

    def _check_finite(self, value: float, count=None) -> None:
        """Every rank sees the same global loss, so all of them stop together (no hang); a failed
        step does not count (the next one is keyed and numbered as this one was)."""
        if not math.isfinite(value):
            self.rollback()
            raise NonFiniteLoss(self.steps_done + 1, self.mesh.rank, value, cause=self._nan_cause(count))
        self.steps_done += 1

    def _nan_cause(self, count) -> str | None:
        """Why the loss is not finite, when this rank can tell (read only after a step failed)."""
        if self.program.step_counts is not None and self._step_tokens is not None:
            counted = self._to_host(self._step_tokens.min(), assumed=1.0)
        else:
            counted = None if count is None else self._to_host(torch.as_tensor(count).sum(), assumed=1.0)
        if counted == 0:
            return "no token was counted: every label of the batch is the loss's ignore_index (-100), so the " \
                "mean divides by zero; drop such batches"
        if saw_index_no_rank_holds(self.gm, self._to_host):
            return "an id or label outside the vocabulary reached a vocabulary-parallel op on this rank (a " \
                "batch already on the device is checked there, inside the step); fix the data"
        return None

    def _scale_reduced(self, factor) -> None:
        """Scale every reduced gradient: the parameters' and ZeRO's slices."""
        self._scale_grads(factor)
        for bucket in self.reducer.buckets:
            if bucket.shard is not None and bucket.shard_grad is not None:
                bucket.shard_grad.mul_(factor)

    @staticmethod
    def _most(held: dict | None, now: dict) -> dict:
        """Per kind of state, the larger of two ``memory_bytes`` readings."""
        return now if held is None else {k: max(v, held[k]) for k, v in now.items()}

    def _scale_grads(self, factor) -> None:
        """Multiply every gradient by factor (a float, or a 0-dim tensor on the device)."""
        if isinstance(factor, float) and factor == 1.0:
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
            micro = self._split(batch)
            self._set_step_divisors(micro)
            loss, *_ = self._loss(micro[0])
        finally:
            self._measure = None
        total = sum(nbytes for nbytes, _ in seen.values())
        del loss
        return total

    @torch.no_grad()
    def evaluate(self, batch: tuple) -> float:
        pieces, micro = [], self.check_batch(batch)
        self._set_step_divisors(micro)
        with self._state_cast_once():
            for m, piece in enumerate(micro):
                self._key_random(self.gm, m)
                pieces.append(self._loss(piece))
        self.pending_writes.clear()  # evaluation updates nothing
        transform = self.program.count_transform
        count = step_count(sum(n for _, n, _ in pieces), transform)
        return self._global(sum(microbatch_share(*piece, transform) for piece in pieces) / count)

    # ------------------------------------------------------------------ full tensors (full_state_dict)
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

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now in parameters (trainable; frozen ones apart), gradients and
        optimizer state (unique storages)."""
        def nbytes(tensors) -> int:
            seen = {}
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()  # also unique for fake tensors
            return sum(seen.values())

        grads = [p.grad for p in self.params] + self.reducer.slices()
        if isinstance(self.optimizer, ZeroOptimizer):
            grads += [m.grad for m in self.optimizer.masters]
            states = self.optimizer.inner.state.values()
        else:
            states = self.optimizer.state.values()
        frozen = [self.state[s.placeholder] for s in self.program.state
                  if s.kind == "param" and not s.trainable and s.placeholder in self.state]
        return {"params": nbytes(self.params), "frozen": nbytes(frozen), "grads": nbytes(grads),
                "optimizer": nbytes(t for state in states for t in state.values())}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded state under every state_dict name (tied weights appear under each name)."""
        if isinstance(self.optimizer, ZeroOptimizer):
            self.optimizer.exact()  # ZeRO's compute-dtype gather left other ranks' slices rounded
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


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A private copy of t on `device` (one copy, whether or not it moves)."""
    return t.to(device, copy=True)


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

    from .mesh import shape_mesh

    device = traced_device(program.gm)
    mesh = shape_mesh(program.mesh.axes, program.mesh.shape, 0, device)
    with FakeTensorMode(allow_non_fake_inputs=True):
        # the state's values are never read: each entry says only whether it trains
        # (_FakeRank._local_piece makes rank 0's piece of its local shape directly)
        state = {spec.name: torch.nn.Parameter(torch.zeros(0, device=device))
                 if spec.kind == "param" and spec.trainable else torch.zeros(0, device=device)
                 for spec in program.state}
        batch = tuple(spec.constant if spec.dtype is None else torch.zeros(spec.global_shape, dtype=spec.dtype,
                                                                             device=device)
                      for spec in program.inputs)
        yield _FakeRank(program, mesh, state, microbatches=1, **options), batch


class _FakeRank(RankExecutor):
    """Rank 0 on fake tensors (``fake_rank_zero``): its state made at its local shapes, and its
    program bound without generating Python (the planner runs it node by node; a direct call
    generates it then)."""

    _share_code = False

    def _local_piece(self, spec, full: torch.Tensor) -> torch.Tensor:
        shape = local_shape(spec.global_shape, spec.layout.placements, self.mesh.shape)
        return torch.zeros(shape, dtype=spec.dtype, device=self.device)


def estimate_activation_bytes(program, **options) -> int:
    """Activation bytes rank 0 saves for backward in one forward, found by running its program on
    fake tensors with peerless collectives (ShapeComm): no memory, no processes, any mesh size."""
    with fake_rank_zero(program, **options) as (rank, batch):
        return rank.activation_bytes(batch)


class PipelineExecutor(PipelineMixin, RankExecutor):
    """A pp rank: runs its stage of the program over microbatches in schedule order."""

    def __init__(self, program, mesh, full_state, *, schedule, **options) -> None:
        self._held = held_inputs(program.gm, schedule.pp, mesh.coord_of("pp"))
        self._deferred = deferred_inputs(program.gm, schedule.pp, mesh.coord_of("pp"))
        RankExecutor.__init__(self, program, mesh, full_state, **options)
        self._setup_pipeline(schedule)
