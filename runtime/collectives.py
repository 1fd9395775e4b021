"""Differentiable collectives and the graph nodes the compiler inserts to call them.

The operators are Megatron's conjugate pairs (Shoeybi et al. 2019, "Megatron-LM", sec. 3, fig. 3:
`f` is identity forward / all-reduce backward, `g` is all-reduce forward / identity backward) and
their sequence-parallel versions (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", sec. 4.2.2: all-gather forward / reduce-scatter backward and back).

Gradient convention: the gradient of a Replicate tensor is itself replicated (every rank holds
the full gradient); the gradient of a Partial tensor is replicated too (each summand gets it).

Each node is an `nn.Module` so it can be a `call_module` target in a torch.fx graph: its
constructor arguments describe it fully, its repr reads back as source, and `bind(mesh)` picks the
rank's Comm (a node is bound per rank; copies come out unbound). On a group of one every node is
the identity and issues nothing.

Example (Megatron MLP, column- then row-parallel; weights held whole and sharded on the fly)::

    f, g = GradAllReduce("tp").bind(mesh), AllReduce("tp").bind(mesh)
    w1_local = LocalShard("tp", dim=0).bind(mesh)(w1)          # (hidden/tp, d)
    w2_local = LocalShard("tp", dim=1).bind(mesh)(w2)          # (d, hidden/tp)
    y = g(torch.relu(f(x) @ w1_local.T) @ w2_local.T)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from .comm import Comm
from .layout import zigzag_permute, zigzag_unpermute

if TYPE_CHECKING:
    from .mesh import Mesh


def _local_piece(x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
    """This rank's chunk of x along dim, checked to split evenly."""
    if x.shape[dim] % comm.size:
        raise ValueError(
            f"cannot shard dim {dim} of shape {tuple(x.shape)} over mesh axis {comm.axis!r} of "
            f"size {comm.size}: not divisible"
        )
    return x.chunk(comm.size, dim)[comm.rank].contiguous()


# ====================================================================== autograd functions
class _AllReduceSumFn(torch.autograd.Function):
    """Megatron g: Partial -> Replicate. Each summand's gradient is the output gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        return comm.all_reduce(x, "sum")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _AllReduceMaxFn(torch.autograd.Function):
    """Partial(max) -> Replicate. The gradient goes to the rank(s) holding the extreme value, as
    torch.amax routes it: split evenly where several ranks tie, zero on the others."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, op: str) -> torch.Tensor:
        out = comm.all_reduce(x, op)
        ctx.comm = comm
        ctx.save_for_backward((x == out).to(x.dtype))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (owner,) = ctx.saved_tensors
        owners = ctx.comm.all_reduce(owner, "sum")
        return grad * owner / owners, None, None


class _GradAllReduceFn(torch.autograd.Function):
    """Megatron f: the input is used by every rank, so its gradient is the sum over ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm) -> torch.Tensor:
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_reduce(grad, "sum"), None


class _AllGatherFn(torch.autograd.Function):
    """Shard(dim) -> Replicate; the gradient is sliced (replicated) or reduce-scattered (partial)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int, grad_is_partial: bool) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.grad_is_partial = comm, dim, grad_is_partial
        return comm.all_gather(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.grad_is_partial:
            return ctx.comm.reduce_scatter(grad, ctx.dim), None, None, None
        return _local_piece(grad, ctx.comm, ctx.dim), None, None, None


class _ReduceScatterFn(torch.autograd.Function):
    """Partial -> Shard(dim); the (replicated) gradient of every summand is the gathered one."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return comm.reduce_scatter(x, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad, ctx.dim), None, None


class _LocalShardFn(torch.autograd.Function):
    """Replicate -> Shard(dim) without communication; the full gradient is gathered back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        return _local_piece(x, comm, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_gather(grad, ctx.dim), None, None


# ============================================================================== graph nodes
class CollectiveNode(nn.Module):
    """Base of the nodes: one mesh axis, bound to that axis's Comm of one rank.

    `kind` is the collective the node causes (in forward or backward; "none" if it never
    communicates); `forward_collective()` / `backward_collective()` say which pass issues what.
    """

    kind: ClassVar[str] = "none"

    def __init__(self, axis: str):
        super().__init__()
        self.axis = axis
        self._comm: Comm | None = None

    def bind(self, mesh: Mesh) -> CollectiveNode:
        """Use this rank's group along `axis`; returns self so it chains."""
        self._comm = mesh.comm(self.axis)
        return self

    @property
    def comm(self) -> Comm:
        if self._comm is None:
            raise RuntimeError(
                f"{self!r} is not bound to a mesh: call node.bind(mesh) with this rank's Mesh "
                f"before running it (the executor binds every collective node of the graph)"
            )
        return self._comm

    def forward_collective(self) -> str | None:
        return None

    def backward_collective(self) -> str | None:
        return None

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}"

    def __getstate__(self) -> dict:
        """Copies (deepcopy, pickle) come out unbound: a Comm belongs to one rank."""
        state = self.__dict__.copy()
        state["_comm"] = None
        return state


class AllReduce(CollectiveNode):
    """Megatron g: all-reduce forward, identity backward (sum). A max or min routes the gradient to
    the rank that owns the extreme value, which takes an all-reduce of the owner counts in backward."""

    kind = "all-reduce"

    def __init__(self, axis: str, op: str = "sum"):
        super().__init__(axis)
        if op not in REDUCE_BACKWARD:
            raise ValueError(f"AllReduce op must be 'sum' or 'max', got {op!r}")
        self.op = op

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            return x
        if self.op == "sum":
            return _AllReduceSumFn.apply(x, comm)
        if not x.is_floating_point():
            return comm.all_reduce(x, self.op)
        return _AllReduceMaxFn.apply(x, comm, self.op)

    def forward_collective(self) -> str | None:
        return "all-reduce"

    def backward_collective(self) -> str | None:
        return REDUCE_BACKWARD[self.op]

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, op={self.op!r}"


# what the backward of an all-reduce issues, by reduce op
REDUCE_BACKWARD = {"sum": None, "max": "all-reduce"}


class GradAllReduce(CollectiveNode):
    """Megatron f: identity forward, all-reduce (sum) of the gradient backward."""

    kind = "all-reduce"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        return x if comm.size == 1 else _GradAllReduceFn.apply(x, comm)

    def backward_collective(self) -> str | None:
        return "all-reduce"


class AllGather(CollectiveNode):
    """Shard(dim) -> Replicate. grad="replicated": backward takes the local chunk of the gradient;
    grad="partial": backward reduce-scatters it (the sequence-parallel pairing)."""

    kind = "all-gather"

    def __init__(self, axis: str, dim: int, grad: str = "replicated", order: str = "contiguous"):
        super().__init__(axis)
        if grad not in ("replicated", "partial"):
            raise ValueError(f"AllGather grad must be 'replicated' or 'partial', got {grad!r}")
        self.dim, self.grad, self.order = dim, grad, _check_order(order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            return x
        dim = self.dim % x.dim()
        out = _AllGatherFn.apply(x, comm, dim, self.grad == "partial")
        return zigzag_unpermute(out, dim, comm.size) if self.order == "zigzag" else out

    def forward_collective(self) -> str | None:
        return "all-gather"

    def backward_collective(self) -> str | None:
        return "reduce-scatter" if self.grad == "partial" else None

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, dim={self.dim}, grad={self.grad!r}" + _order_repr(self.order)


class ReduceScatter(CollectiveNode):
    """Partial -> Shard(dim): reduce-scatter forward, all-gather backward."""

    kind = "reduce-scatter"

    def __init__(self, axis: str, dim: int, order: str = "contiguous"):
        super().__init__(axis)
        self.dim, self.order = dim, _check_order(order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _split_along(x, self.comm, self.dim, self.order, _ReduceScatterFn)

    def forward_collective(self) -> str | None:
        return "reduce-scatter"

    def backward_collective(self) -> str | None:
        return "all-gather"

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, dim={self.dim}" + _order_repr(self.order)


class LocalShard(CollectiveNode):
    """Replicate -> Shard(dim) with no communication; backward all-gathers the gradient."""

    kind = "all-gather"

    def __init__(self, axis: str, dim: int, order: str = "contiguous"):
        super().__init__(axis)
        self.dim, self.order = dim, _check_order(order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _split_along(x, self.comm, self.dim, self.order, _LocalShardFn)

    def backward_collective(self) -> str | None:
        return "all-gather"

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, dim={self.dim}" + _order_repr(self.order)


class AllToAll(CollectiveNode):
    """Shard(from_dim) -> Shard(to_dim) on one axis (Ulysses: sequence shards for head shards).

    Each rank splits its piece along ``to_dim``, sends part j to rank j, and concatenates what it
    receives along ``from_dim``. Backward is the reverse exchange.

    ``whole_elsewhere``: the received pieces are concatenated along ``from_dim`` as if this axis
    alone split it, so no other mesh axis may split ``from_dim`` of the input (the compiler gathers
    it first). Ulysses needs this for the sequence: with sp=on the sequence is split over tp as well,
    and a cp exchange of tp-subdivided chunks would leave each rank a non-contiguous sequence."""

    kind = "all-to-all"

    def __init__(self, axis: str, from_dim: int, to_dim: int, *, whole_elsewhere: bool = False):
        super().__init__(axis)
        self.from_dim, self.to_dim, self.whole_elsewhere = from_dim, to_dim, whole_elsewhere

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        comm = self.comm
        if comm.size == 1:
            return x
        return _AllToAllFn.apply(x, comm, self.from_dim % x.dim(), self.to_dim % x.dim())

    @staticmethod
    def global_fn(x: torch.Tensor) -> torch.Tensor:
        return x

    def forward_collective(self) -> str | None:
        return "all-to-all"

    def backward_collective(self) -> str | None:
        return "all-to-all"

    def extra_repr(self) -> str:
        return f"axis={self.axis!r}, from_dim={self.from_dim}, to_dim={self.to_dim}"


class _AllToAllFn(torch.autograd.Function):
    """x sharded on from_dim -> sharded on to_dim: split along to_dim, exchange, concatenate along
    from_dim. Backward: the same exchange with the dims swapped."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, from_dim: int, to_dim: int) -> torch.Tensor:
        ctx.comm, ctx.from_dim, ctx.to_dim = comm, from_dim, to_dim
        return comm.all_to_all(x.contiguous(), to_dim, from_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.all_to_all(grad.contiguous(), ctx.from_dim, ctx.to_dim), None, None, None


def _split_along(x: torch.Tensor, comm: Comm, dim: int, order: str, fn) -> torch.Tensor:
    """Apply a splitting collective (reduce-scatter, local shard) along dim in the axis's chunk
    order: zigzag permutes the dim first, so a contiguous chunk is the rank's zigzag piece."""
    if comm.size == 1:
        return x
    dim = dim % x.dim()
    if order == "zigzag":
        x = zigzag_permute(x, dim, comm.size)
    return fn.apply(x, comm, dim)


ORDERS = ("contiguous", "zigzag")


def _check_order(order: str) -> str:
    if order not in ORDERS:
        raise ValueError(f"chunk order must be one of {ORDERS}, got {order!r}")
    return order


def _order_repr(order: str) -> str:
    return "" if order == "contiguous" else f", order={order!r}"


class AxisIndex(CollectiveNode):
    """This rank's coordinate on `axis` as a Python int (vocab-parallel ops use it for their
    slice offset). No communication, no gradient."""

    kind = "none"

    def forward(self) -> int:
        return self.comm.rank
