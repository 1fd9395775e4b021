"""The compiled program: one per-rank GraphModule plus what the runtime needs to feed it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial

from .ir import META, Layout, MeshSpec
from .trace import StateInput
from usc.runtime.loss_value import LossValueReduction, StepCounts


@dataclass(frozen=True)
class StateSpec:
    """A parameter or buffer: how it is laid out, and over which axes its gradient is summed."""

    placeholder: str
    name: str
    kind: str
    aliases: tuple[str, ...]
    layout: Layout
    global_shape: tuple[int, ...]
    dtype: torch.dtype
    grad_axes: tuple[str, ...] = ()
    trainable: bool = True
    zero3: bool = False  # the placeholder holds this rank's 1/dp slice (ZeRO-3)


@dataclass(frozen=True)
class InputSpec:
    placeholder: str
    layout: Layout
    global_shape: tuple[int, ...]
    dtype: torch.dtype | None = torch.int64  # None: not a tensor (a Python value the trace baked in)
    constant: object = None  # that value (``return_loss=True`` in a batch dict, an int count)


def _input_spec(node: fx.Node) -> InputSpec:
    """A tensor input's layout, shape and dtype; a Python value (bool, int, None) the trace specialised
    on is kept as that value (the program computes with it, whatever a later batch holds)."""
    value = node.meta["val"]
    if isinstance(value, torch.Tensor):
        return InputSpec(node.name, node.meta[META].layout, tuple(value.shape), value.dtype)
    return InputSpec(node.name, node.meta[META].layout, (), None, constant=value)


@dataclass
class Program:
    """Everything the runtime needs; it never re-plans."""

    gm: fx.GraphModule
    mesh: MeshSpec
    state: list[StateSpec]
    inputs: list[InputSpec]
    loss_layout: Layout
    tp_choices: list = field(default_factory=list)
    timings: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    loss_dtype: torch.dtype = torch.float32
    loss_counted: bool = False  # the graph returns (loss, token count[, its numerator where the count is 0])
    # a token mean's floor or offset on its count (("clamp_min", m) or ("add", eps)), applied to the step's count
    count_transform: tuple[str, float] | None = None
    # token means divided by the step's count, summed before the first microbatch (passes/loss_count.py)
    step_counts: StepCounts | None = None

    def listing(self) -> str:
        """This program as text, alike on two processes exactly when their programs are (``program_listing``)."""
        return program_listing(self)

    @property
    def loss_partial_axes(self) -> tuple[str, ...]:
        return tuple(a for a, p in zip(self.mesh.axes, self.loss_layout.placements) if isinstance(p, Partial))

    @property
    def loss_value(self) -> LossValueReduction:
        """How the runtime returns the step's loss (what it sends, which the report counts)."""
        counts = self.step_counts.axes if self.step_counts is not None else ()
        return LossValueReduction(self.loss_partial_axes, self.loss_dtype, self.loss_counted,
                                  self.mesh.size("pp") > 1, step_counts=counts).over({a: self.mesh.size(a) for a in self.mesh.axes})


def build_program(gm: fx.GraphModule, mesh: MeshSpec, state: list[StateInput], user_inputs: list[str],
                  tp_choices: list, timings: list) -> Program:
    nodes = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    specs = []
    for s in state:
        node = nodes[s.placeholder]
        ann = node.meta[META]
        value = node.meta["val"]
        specs.append(StateSpec(s.placeholder, s.name, s.kind, s.aliases or (s.name,), ann.layout,
                               tuple(value.shape), value.dtype, ann.partial_grad_axes, s.trainable,
                               bool(ann.extra.get("zero3"))))
    inputs = [_input_spec(nodes[n]) for n in user_inputs]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    values = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)  # (loss[, count[, empty]])
    loss = inner_node(gm, values[0])
    return Program(gm, mesh, specs, inputs, loss.meta[META].layout, tp_choices, timings,
                   loss_dtype=loss.meta["val"].dtype, loss_counted=len(values) > 1,
                   count_transform=gm.meta.get("usc_count_transform"), step_counts=gm.meta.get("usc_step_counts"))


def inner_node(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """The annotated node behind a value of a pipeline orchestrator (a stage output), or node."""
    if META in node.meta:
        return node
    index = None
    if node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
        node, index = node.args[0], node.args[1]
    stage = gm.get_submodule(node.target)
    out = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    return out[index] if index is not None else (out[0] if isinstance(out, (tuple, list)) else out)


def program_listing(program: Program) -> str:
    """The program as text that two processes write alike when, and only when, they hold the same
    program: every graph's nodes in order (op, target, arguments, the output's layout), every other
    module with its settings (a collective's axis), the mesh, and each state tensor's and input's
    layout. Nothing in it depends on the process: no addresses, devices by type only (cuda:3 and
    cuda:0 read 'cuda'). The ranks of a job compare its hash before they train (runtime/agreement.py)."""
    mesh = program.mesh
    lines = [f"mesh {mesh.axes} {mesh.shape} zigzag={mesh.zigzag}"]
    lines += [f"state {s.placeholder} {s.name} {s.kind} {s.layout} {s.global_shape} {s.dtype} grad_axes={s.grad_axes} "
              f"trainable={s.trainable} zero3={s.zero3}" for s in program.state]
    lines += [f"input {i.placeholder} {i.layout} {i.global_shape} {i.dtype} {_text(i.constant)}" for i in program.inputs]
    lines.append(f"loss {program.loss_layout} {program.loss_dtype} counted={program.loss_counted} "
                 f"{_text(program.count_transform)}")
    for name, module in program.gm.named_modules():
        if isinstance(module, fx.GraphModule):
            lines.append(f"graph {name or '(top)'}")
            for node in module.graph.nodes:
                ann = node.meta.get(META)
                layout = f" -> {ann.layout}" if ann is not None and getattr(ann, "layout", None) is not None else ""
                target = node.target if isinstance(node.target, str) else _text(node.target)
                lines.append(f"  {node.name} = {node.op} {target} {_text(node.args)} {_text(node.kwargs)}{layout}")
        else:
            lines.append(f"module {name} {type(module).__module__}.{type(module).__qualname__}({module.extra_repr()})")
        for attr, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            lines.append(f"  tensor {name}.{attr} {tuple(value.shape)} {value.dtype}")
    return "\n".join(lines)


def _text(value) -> str:
    """An argument as process-independent text (``program_listing``)."""
    if isinstance(value, fx.Node):
        return f"%{value.name}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_text(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_text(k)}: {_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, torch.device):
        return f"device({value.type!r})"
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)} {value.dtype}"
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.memory_format, torch.layout,
                                           slice, type(Ellipsis))):
        return repr(value)
    if isinstance(value, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)):
        return str(value)
    if callable(value):
        return f"{getattr(value, '__module__', None)}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text
