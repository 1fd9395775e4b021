"""The pipeline stage table of the report: per stage its layers, estimated FLOPs, parameter bytes and
the activations it sends across each cut (read from the orchestrator the split pass made)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .ir import META
from .program import Program
from usc.runtime.sizes import shape_bytes


@dataclass(frozen=True)
class StageTransfer:
    """One activation a stage sends to a later stage per microbatch (its gradient comes back if grad)."""

    to_stage: int
    value: str
    shape: tuple[int, ...]  # this rank's tensor
    dtype: str
    bytes: int
    grad: bool


@dataclass(frozen=True)
class StageRecord:
    index: int
    rank: int  # the pp rank that runs it (stage % pp)
    modules: tuple[str, ...]
    flops: float  # per microbatch, from the global shapes (what the split balanced)
    param_bytes: int  # this rank's parameters used by the stage (before ZeRO sharding)
    sends: tuple[StageTransfer, ...]
    # the split's memory estimate (automatic split): parameters with gradients and optimizer state
    # after ZeRO, activations kept per microbatch, and the schedule's peak microbatches in flight
    state_bytes: float | None = None
    activation_bytes: float | None = None
    in_flight: int | None = None

    @property
    def memory_bytes(self) -> float | None:
        """The estimated peak a device holds for this stage (None for a manual split)."""
        if self.state_bytes is None:
            return None
        return self.state_bytes + self.in_flight * self.activation_bytes


def state_of_pp_rank(program: Program, rank: int = 0) -> list:
    """The state entries a pipeline rank keeps (those its stages take); all of them without pp.
    The memory prediction and the gradient buckets of the report are pp rank 0's."""
    if not program.gm.meta.get("usc_stage_costs"):
        return list(program.state)
    pp = program.mesh.size("pp")
    taken = {a.name for k, node in enumerate(_stage_nodes(program.gm)) if k % pp == rank
             for a in node.args if isinstance(a, fx.Node) and a.op == "placeholder"}
    return [s for s in program.state if s.placeholder in taken]


def shared_weights(program: Program) -> list:
    """The trainable parameters that stages on two pp ranks use (a tied embedding / lm head): the
    pipeline executor sums their gradients over pp (runtime/pipeline.py); [] without pp."""
    if not program.gm.meta.get("usc_stage_costs"):
        return []
    pp = program.mesh.size("pp")
    ranks: dict[str, set[int]] = {}
    for k, node in enumerate(_stage_nodes(program.gm)):
        for arg in node.args:
            if isinstance(arg, fx.Node) and arg.op == "placeholder":
                ranks.setdefault(arg.name, set()).add(k % pp)
    return [s for s in program.state
            if s.kind == "param" and s.trainable and len(ranks.get(s.placeholder, ())) > 1]


def _stage_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "call_module" and isinstance(gm.get_submodule(n.target), fx.GraphModule)]


def _output_node(stage: fx.GraphModule, position: int) -> fx.Node:
    outputs = next(n for n in stage.graph.nodes if n.op == "output").args[0]
    return outputs[position] if isinstance(outputs, (tuple, list)) else outputs


def _sends(gm: fx.GraphModule, program: Program, nodes: list[fx.Node]) -> dict[int, list[StageTransfer]]:
    index = {node: i for i, node in enumerate(nodes)}
    sends: dict[int, list[StageTransfer]] = {i: [] for i in range(len(nodes))}
    for consumer in nodes:
        for arg in consumer.args:
            producer = arg.args[0] if arg.op == "call_function" else arg
            if producer not in index:
                continue
            inner = _output_node(gm.get_submodule(producer.target), arg.args[1] if arg.op == "call_function" else 0)
            value = inner.meta["val"]
            shape = inner.meta[META].layout.local_shape(tuple(value.shape), program.mesh)
            sends[index[producer]].append(StageTransfer(index[consumer], inner.name, shape,
                                                        str(value.dtype).replace("torch.", ""),
                                                        shape_bytes(shape, value.dtype), bool(inner.meta[META].needs_grad)))
    return sends


def stage_table(program: Program) -> list[StageRecord]:
    """One record per pipeline stage, in order; [] without pp."""
    gm = program.gm
    costs = gm.meta.get("usc_stage_costs")
    if not costs:
        return []
    nodes = _stage_nodes(gm)
    params = {s.placeholder: s for s in program.state if s.kind == "param"}
    sends = _sends(gm, program, nodes)
    pp = program.mesh.size("pp")
    records = []
    for i, (node, cost) in enumerate(zip(nodes, costs)):
        used = {a.name for a in node.args if isinstance(a, fx.Node) and a.op == "placeholder" and a.name in params}
        nbytes = sum(shape_bytes(params[p].layout.local_shape(params[p].global_shape, program.mesh), params[p].dtype)
                     for p in used)
        records.append(StageRecord(i, i % pp, tuple(cost["modules"]), cost["flops"], nbytes, tuple(sends[i]),
                                   cost.get("state_bytes"), cost.get("activation_bytes"), cost.get("in_flight")))
    return records
