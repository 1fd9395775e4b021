"""Every collective node states its forward and its backward; this checks both on simulated ranks.

A node maps a global value to itself, laid out differently: ``(node, input layout, input gradient,
output layout, output gradient)``. Forward: the input's pieces go in, the output's pieces must
assemble to the same global value. Backward: each rank's upstream gradient is laid out as the
output gradient says; the local input gradients must assemble, as the input gradient says, to the
global upstream gradient (the node is the identity on the global value).

Gradient layouts: "whole" (every rank holds the full gradient), "summands" (the ranks' gradients
sum to it), "chunks" (Shard: this rank's piece), "owner" (Partial(max): the rank holding the max
gets it, the others zero).

    python -m usc.testing.verify_collectives
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from usc.runtime.collectives import AllGather, AllReduce, AllToAll, GradAllReduce, LocalShard, ReduceScatter
from usc.runtime.layout import zigzag_permute, zigzag_unpermute
from usc.runtime.mesh import run_in_threads, simulated_meshes

from .rule_check import split_partial

AXIS = "x"
R = Replicate()


@dataclass(frozen=True)
class Contract:
    node: nn.Module
    inputs: object  # placement
    input_grad: str
    output: object
    output_grad: str
    order: str = "contiguous"

    def __str__(self) -> str:
        return f"{self.node!r}: {self.inputs}/{self.input_grad} -> {self.output}/{self.output_grad}"


def contracts() -> list[Contract]:
    out = [Contract(AllReduce(AXIS, "sum"), Partial("sum"), "whole", R, "whole"),
           Contract(AllReduce(AXIS, "max"), Partial("max"), "owner", R, "whole"),
           Contract(GradAllReduce(AXIS), R, "whole", R, "summands"),
           Contract(AllToAll(AXIS, 1, 0), Shard(1), "chunks", Shard(0), "chunks")]
    for order in ("contiguous", "zigzag"):
        for d in (0, 1):
            out += [Contract(AllGather(AXIS, d, order=order), Shard(d), "chunks", R, "whole", order),
                    Contract(AllGather(AXIS, d, grad="partial", order=order), Shard(d), "chunks", R, "summands", order),
                    Contract(ReduceScatter(AXIS, d, order=order), Partial("sum"), "whole", Shard(d), "chunks", order),
                    Contract(LocalShard(AXIS, d, order=order), R, "whole", Shard(d), "chunks", order)]
    return out


def _pieces(value: torch.Tensor, placement, size: int, order: str, seed: int) -> list[torch.Tensor]:
    """Each rank's piece of a global value laid out as ``placement``."""
    if isinstance(placement, Replicate):
        return [value.clone() for _ in range(size)]
    if isinstance(placement, Shard):
        laid = zigzag_permute(value, placement.dim, size) if order == "zigzag" else value
        return [c.clone() for c in laid.chunk(size, placement.dim)]
    if placement.reduce_op == "sum":
        return split_partial(value, size, seed)
    g = torch.Generator().manual_seed(seed)
    owner = torch.randint(0, size, value.shape, generator=g)
    return [torch.where(owner == r, value, value - 0.5 - torch.rand(value.shape, generator=g, dtype=value.dtype))
            for r in range(size)]


def _grad_pieces(grad: torch.Tensor, how: str, placement, size: int, order: str, seed: int) -> list[torch.Tensor]:
    if how == "whole":
        return [grad.clone() for _ in range(size)]
    if how == "summands":
        return split_partial(grad, size, seed)
    return _pieces(grad, placement, size, order, seed)


def _assemble(pieces: list[torch.Tensor], placement, size: int, order: str) -> torch.Tensor:
    whole = torch.cat(pieces, placement.dim)
    return zigzag_unpermute(whole, placement.dim, size) if order == "zigzag" else whole


def check(contract: Contract, size: int, seed: int = 0) -> str | None:
    """None when the node keeps its contract on ``size`` ranks, else what differs."""
    g = torch.Generator().manual_seed(seed)
    value = torch.randn(4 * size, 6 * size, generator=g, dtype=torch.float64)
    upstream = torch.randn(value.shape, generator=g, dtype=torch.float64)
    inputs = _pieces(value, contract.inputs, size, contract.order, seed + 1)
    ups = _grad_pieces(upstream, contract.output_grad, contract.output, size, contract.order, seed + 2)

    def rank(mesh):
        r = mesh.comm(AXIS).rank
        x = inputs[r].clone().requires_grad_()
        y = copy.deepcopy(contract.node).bind(mesh)(x)
        y.backward(ups[r])
        return y.detach(), x.grad

    results = run_in_threads(simulated_meshes((AXIS,), (size,), timeout=30.0), rank, timeout=60.0)
    outs, grads = [o for o, _ in results], [gr for _, gr in results]
    if isinstance(contract.output, Shard):
        got = [_assemble(outs, contract.output, size, contract.order)]
    else:
        got = outs
    if not all(torch.allclose(o, value, rtol=1e-12, atol=1e-12) for o in got):
        return "forward: the output does not assemble to the input's global value"
    owns = [x == value for x in inputs] if contract.input_grad == "owner" else []
    return _grad_problem(grads, upstream, contract, size, owns)


def _grad_problem(grads, upstream, contract: Contract, size: int, owns) -> str | None:
    how = contract.input_grad
    want = [upstream]
    if how == "chunks":
        got = [_assemble(grads, contract.inputs, size, contract.order)]
    elif how == "summands":
        got = [sum(grads)]
    elif how == "owner":  # the rank holding the max gets the gradient, the others zero
        got, want = grads, [upstream * mask for mask in owns]
    else:
        got, want = grads, [upstream] * size
    if not all(g is not None and torch.allclose(g, w, rtol=1e-12, atol=1e-12) for g, w in zip(got, want)):
        return f"backward: the input gradients are not the upstream gradient laid out as '{how}'"
    return None


def main() -> int:
    failures = 0
    for contract in contracts():
        for size in (2, 3):
            problem = check(contract, size)
            failures += problem is not None
            print(f"{'FAIL' if problem else 'ok  '} size={size} {contract}" + (f": {problem}" if problem else ""))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
