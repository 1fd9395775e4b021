"""Pipeline executor: one pp rank runs its stage of the program over microbatches, by schedule.

The compiler hands an orchestrator GraphModule whose ``submod_k`` are the stages. From it this
module reads, as plain data, what each stage takes (program inputs, or outputs of earlier stages)
and where its outputs go. A rank then follows its list of schedule actions: F(m) receives the
stage's inputs of microbatch m from the stages that make them, runs the stage and sends its
outputs on; B(m) receives the gradients of those outputs, runs backward and sends the gradients
of what it received back. Sends never wait (gloo isend / buffered in the simulator), receives
match in post order per pair of stages, and the schedule checker has proved the order deadlock
free.

The loss: each microbatch's backward starts from its token *sum* (loss x count); after the last
microbatch every gradient is divided by the global count N, so the step equals the global token
mean on one device (ALGORITHMS.md, "Gradients of a microbatch-split batch").
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx


@dataclass
class StageSpec:
    """What stage k takes and gives. Sources: ("input", placeholder) or ("stage", j, output index)."""

    index: int
    module: str
    sources: list[tuple] = field(default_factory=list)
    outputs: list[tuple[tuple[int, ...], torch.dtype, bool]] = field(default_factory=list)  # shape, dtype, grad
    consumers: dict[int, list[int]] = field(default_factory=dict)  # output index -> consumer stages


def stage_specs(top: fx.GraphModule, local_shape) -> list[StageSpec]:
    """Read the orchestrator graph. local_shape(inner_node) -> this rank's shape of a stage output."""
    specs, by_node = [], {}
    for node in top.graph.nodes:
        if node.op != "call_module":
            continue
        spec = StageSpec(len(specs), node.target)
        for arg in node.args:
            spec.sources.append(_source(arg, by_node))
        stage = top.get_submodule(node.target)
        spec.outputs = [(local_shape(n), n.meta["val"].dtype, _needs_grad(n)) for n in _outputs(stage)]
        by_node[node] = spec
        specs.append(spec)
    for spec in specs:
        for source in spec.sources:
            if source[0] == "stage":
                specs[source[1]].consumers.setdefault(source[2], []).append(spec.index)
    return specs


def _outputs(stage: fx.GraphModule) -> list[fx.Node]:
    out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _needs_grad(node: fx.Node) -> bool:
    ann = node.meta.get("usc")
    return bool(ann is not None and ann.needs_grad)


def _source(arg: fx.Node, by_node: dict) -> tuple:
    if arg.op == "placeholder":
        return ("input", arg.name)
    if arg.op == "call_function" and arg.target is operator.getitem:
        return ("stage", by_node[arg.args[0]].index, arg.args[1])
    return ("stage", by_node[arg].index, 0)


def messages_from(specs: list[StageSpec], producer: int, consumer: int) -> list[int]:
    """Output indices of ``producer`` that ``consumer`` receives, in the one order both sides use."""
    return sorted(i for i, users in specs[producer].consumers.items() if consumer in users)


@dataclass
class InFlight:
    """What one microbatch's forward left for its backward on this stage."""

    received: dict[tuple[int, int], torch.Tensor]
    outputs: list[torch.Tensor]
    count: float = 1.0


class PipelineMixin:
    """Stage execution for RankExecutor (see the module docstring); mixed in by PipelineExecutor."""

    def _setup_pipeline(self, schedule) -> None:
        top = self.gm
        mesh_spec = self.program.mesh
        self.specs = stage_specs(top, lambda n: n.meta["usc"].layout.local_shape(tuple(n.meta["val"].shape),
                                                                                  mesh_spec))
        self.stage = self.mesh.coord_of("pp")
        self.spec = self.specs[self.stage]
        self.stage_module = top.get_submodule(self.spec.module)
        self.pp = self.mesh.comm("pp")
        self.actions = [a for a in schedule.actions[self.stage]]
        self._pending: list = []
        users: dict[str, set[int]] = {}
        for spec in self.specs:
            for source in spec.sources:
                if source[0] == "input":
                    users.setdefault(source[1], set()).add(spec.index)
        self.owner = {name: min(stages) for name, stages in users.items()}
        self.shared = sorted(name for name, stages in users.items() if len(stages) > 1 and name in self.state
                             and isinstance(self.state[name], torch.nn.Parameter))

    # ----------------------------------------------------------------------------- one microbatch
    def _receive_inputs(self) -> dict[tuple[int, int], torch.Tensor]:
        received = {}
        for producer in range(self.stage):
            for index in messages_from(self.specs, producer, self.stage):
                shape, dtype, grad = self.specs[producer].outputs[index]
                value = self.pp.recv(torch.empty(shape, dtype=self._wire(dtype)), producer)
                received[(producer, index)] = value.requires_grad_(grad and dtype.is_floating_point)
        return received

    def _forward(self, piece: tuple) -> InFlight:
        values = self._input_values(piece)
        received = self._receive_inputs()
        args = [values[s[1]] if s[0] == "input" else received[(s[1], s[2])] for s in self.spec.sources]
        with self._saved_tensor_hooks():
            out = self.stage_module(*args)
        outputs = list(out) if isinstance(out, (tuple, list)) else [out]
        for consumer in sorted({c for users in self.spec.consumers.values() for c in users}):
            for index in messages_from(self.specs, self.stage, consumer):
                self._send(outputs[index].detach().to(self._wire(outputs[index].dtype)), consumer)
        count = float(outputs[1]) if self._last and len(outputs) > 1 else 1.0
        return InFlight(received, outputs, count)

    def _send(self, t: torch.Tensor, peer: int) -> None:
        """Sends never block the schedule (a blocking send to a stage that is itself sending would
        deadlock 1F1B); they are waited for at the end of the step."""
        self._pending.append((t, self.pp.send(t, peer, async_op=True)))

    def _wait_sends(self) -> None:
        for _, work in self._pending:
            work.wait()
        self._pending = []

    def _wire(self, dtype: torch.dtype) -> torch.dtype:
        """Float activations and gradients travel in the compute dtype (bf16 under dtype=bf16)."""
        return self.compute_dtype if self.compute_dtype is not None and dtype.is_floating_point else dtype

    @property
    def _last(self) -> bool:
        return self.stage == len(self.specs) - 1

    def _input_values(self, piece: tuple) -> dict[str, torch.Tensor]:
        values = {name: self._compute(t) for name, t in self.state.items()}
        for spec, value in zip(self.program.inputs, piece):
            values[spec.placeholder] = self._compute(self._local_input(spec, value))
        return values

    def _backward(self, flight: InFlight) -> None:
        if self._last:
            (flight.outputs[0] * flight.count).backward()
        else:
            grads = [None] * len(flight.outputs)
            for consumer in sorted({c for users in self.spec.consumers.values() for c in users}):
                for index in messages_from(self.specs, self.stage, consumer):
                    shape, dtype, needs = self.spec.outputs[index]
                    if needs and dtype.is_floating_point:
                        g = self.pp.recv(torch.empty(shape, dtype=self._wire(dtype)), consumer)
                        g = g.to(flight.outputs[index].dtype)
                        grads[index] = g if grads[index] is None else grads[index] + g
            pairs = [(o, g) for o, g in zip(flight.outputs, grads) if g is not None and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for (producer, index), value in sorted(flight.received.items()):
            shape, dtype, needs = self.specs[producer].outputs[index]
            if needs and dtype.is_floating_point:
                grad = value.grad if value.grad is not None else torch.zeros_like(value)
                self._send(grad.to(self._wire(dtype)), producer)

    # ------------------------------------------------------------------------------------ a step
    def _run_schedule(self, batch: tuple, *, train: bool) -> tuple[torch.Tensor, float]:
        micro = self._split(batch)
        flights: dict[int, InFlight] = {}
        total, count = torch.zeros((), dtype=torch.float64), 0.0
        for action in self.actions:
            if action.op.value == "F":
                with self._span(f"F{action.mb}"):
                    if train:
                        flights[action.mb] = self._forward(micro[action.mb])
                    else:
                        with torch.no_grad():
                            flights[action.mb] = self._forward(micro[action.mb])
                flight = flights[action.mb]
                if self._last:
                    total = total + flight.outputs[0].detach().double() * flight.count
                    count += flight.count
            elif train:
                with self.reducer.no_sync(), self._span(f"B{action.mb}"):
                    self._backward(flights.pop(action.mb))
        return total, count

    def _pipeline_global(self, total: torch.Tensor, count: float) -> tuple[torch.Tensor, float]:
        """The last stage's (token-weighted loss sum, count), on every pp rank."""
        both = torch.stack([total.double(), torch.tensor(count, dtype=torch.float64)])
        if not self._last:
            both = torch.zeros_like(both)
        both = self.pp.all_reduce(both)
        return both[0], float(both[1])

    def step(self, batch: tuple) -> float:
        total, count = self._run_schedule(batch, train=True)
        self._wait_sends()
        total, count = self._pipeline_global(total, count)
        self._scale_grads(1.0 / count)
        self._sum_shared_grads()  # before the dp reduction: ZeRO-2 keeps only slices after it
        self.reducer.finish()
        self.peak_state_bytes = self.memory_bytes()
        value = self._global(total / count)
        self._check_finite(value)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return value

    def evaluate(self, batch: tuple) -> float:
        total, count = self._run_schedule(batch, train=False)
        self._wait_sends()
        total, count = self._pipeline_global(total, count)
        return self._global(total / count)

    def _sum_shared_grads(self) -> None:
        """A weight used by two stages (tied embedding / lm head) gets both stages' gradients."""
        for name in self.shared:
            param = self.state[name]
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            param.grad = self.pp.all_reduce(grad)

    def _owned(self, spec, value: torch.Tensor) -> torch.Tensor:
        """The owning stage's value of a state tensor, on every pp rank."""
        mine = value if self.owner.get(spec.placeholder, 0) == self.stage else torch.zeros_like(value)
        return self.pp.all_reduce(mine)
