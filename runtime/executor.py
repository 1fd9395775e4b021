"""The per-rank executor: runs one rank's compiled program for forward, backward and the update.

It receives plain values from the compiler (the program's graph, the layout of every state
tensor and input, the axes to reduce) and never re-plans. The same executor runs under torchrun
(one process per rank, torch.distributed groups) and in the simulator (one thread per rank,
in-memory collectives): only the Mesh it is given differs.
"""

from __future__ import annotations

import copy
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx

from .layout import gather_full, local_chunk, zigzag_permute
from .reducer import GradReducer
from .trace import Timeline

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]


def default_optimizer(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params)


def bind_graph(gm: fx.GraphModule, mesh) -> fx.GraphModule:
    """A rank's copy of the program: its own collective modules bound to its mesh, graph shared."""
    modules = {}
    for name, module in gm.named_children():
        mine = copy.deepcopy(module)
        if hasattr(mine, "bind"):
            mine.bind(mesh)
        modules[name] = mine
    return fx.GraphModule(modules, gm.graph, class_name="RankProgram")


class RankExecutor:
    """One rank: local shards of the state, the bound program, the optimizer and the grad reducer."""

    def __init__(self, program, mesh, full_state: Mapping[str, torch.Tensor], *,
                 optimizer: OptimizerFactory | None = None, bucket_bytes: int = 25 * 2**20) -> None:
        self.program, self.mesh = program, mesh
        self.gm = bind_graph(program.gm, mesh)
        self.state: dict[str, torch.Tensor] = {}
        self.params: list[torch.nn.Parameter] = []
        for spec in program.state:
            self.state[spec.placeholder] = self._local_state(spec, full_state[spec.name])
        entries = [(s.name, self.state[s.placeholder], s.grad_axes) for s in program.state
                   if isinstance(self.state[s.placeholder], torch.nn.Parameter)]
        self.timeline: Timeline | None = None
        self.reducer = GradReducer(entries, mesh, bucket_bytes=bucket_bytes)
        self.optimizer = (optimizer or default_optimizer)(self.params)
        self._order = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"]

    def _local_state(self, spec, full: torch.Tensor) -> torch.Tensor:
        local = local_chunk(full.detach(), spec.layout.placements, self.mesh.shape, self.mesh.coord).clone()
        if spec.kind == "param" and full.requires_grad:
            param = torch.nn.Parameter(local)
            self.params.append(param)
            return param
        return local

    def _arguments(self, batch: tuple) -> list[torch.Tensor]:
        if len(batch) != len(self.program.inputs):
            raise TypeError(f"the compiled model takes {len(self.program.inputs)} inputs "
                            f"({', '.join(i.placeholder for i in self.program.inputs)}); got {len(batch)}")
        values = dict(self.state)
        for spec, value in zip(self.program.inputs, batch):
            values[spec.placeholder] = self._local_input(spec, value)
        return [values[name] for name in self._order]

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

    def _loss(self, batch: tuple) -> torch.Tensor:
        out = self.gm(*self._arguments(batch))
        return out[0] if isinstance(out, (tuple, list)) else out

    def _global(self, loss: torch.Tensor) -> float:
        value = loss.detach()
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
        """One optimizer step on the global batch; returns the global mean loss."""
        with self._span("forward"):
            loss = self._loss(batch)
        with self._span("backward"):
            loss.backward()
        self.reducer.finish()
        with self._span("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self._global(loss)

    def activation_bytes(self, batch: tuple) -> int:
        """Bytes of the activations autograd saves for backward in one forward (unique storages,
        parameters excluded): the activation memory a step holds at its peak, measured."""
        params = {p.untyped_storage().data_ptr() for p in self.params}
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = self._loss(batch)
        del loss
        return sum(seen.values())

    @torch.no_grad()
    def evaluate(self, batch: tuple) -> float:
        return self._global(self._loss(batch))

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded state under every state_dict name (tied weights appear under each name)."""
        out = {}
        for spec in self.program.state:
            full = gather_full(self.state[spec.placeholder].detach(), spec.layout.placements, self.mesh)
            for name in spec.aliases:
                out[name] = full
        return out

    def local_state(self) -> dict[str, torch.Tensor]:
        return {spec.name: self.state[spec.placeholder].detach() for spec in self.program.state}


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
