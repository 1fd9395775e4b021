"""Expert parallelism: routed tokens dispatched to the ranks that hold their experts and combined back.

The algorithm (GShard, Lepikhin et al. 2020; DeepSpeed-MoE and
Megatron-Core's all-to-all token dispatcher): every (token, slot) assignment goes to the ep rank
holding its expert. Each rank sorts its assignments by (expert, token order), tells every peer how
many rows it will send per local expert of that peer (an all-to-all of counts), then sends the
hidden rows with ``all_to_all_single`` and uneven splits. The receiver groups the rows by local
expert, runs its experts, and sends the results back with the reverse exchange; the sender
un-permutes them, weights them by the router weights and sums the k slots of each token.
Backward is the same two exchanges in reverse (the gradient of an all-to-all is the all-to-all
with in and out splits swapped).

Dropless by default: equal to the single-device model. With a capacity C per expert, the
assignments an expert keeps are the first C in *global* token order: each rank learns from an
all-gather of per-expert counts how many assignments to each expert the earlier token shards
hold, so the same tokens drop as on one device.

Example (one rank, no peers: the dropless single-device computation)::

    moe = ExpertParallelMoE(num_experts=4, top_k=2, stacked=True).bind(mesh)
    out = moe(x, weights, indices, w_gate, w_up, w_down)        # stacked weights [E, in, out]
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .collectives import CollectiveNode
from .comm import Comm

if TYPE_CHECKING:
    from .mesh import Mesh


class _AllToAllSingleFn(torch.autograd.Function):
    """Uneven all-to-all of rows; backward sends the gradient rows back the way they came."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, out_splits: list, in_splits: list, stats: Counter, name: str):
        ctx.comm, ctx.splits, ctx.stats, ctx.name = comm, (out_splits, in_splits), stats, name
        stats[f"{name} forward"] += x.numel() * x.element_size()
        return comm.all_to_all_single(x.contiguous(), out_splits, in_splits)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        ctx.stats[f"{ctx.name} backward"] += grad.numel() * grad.element_size()
        return ctx.comm.all_to_all_single(grad.contiguous(), in_splits, out_splits), None, None, None, None, None


def exchange_rows(x: torch.Tensor, comm: Comm, out_splits: list, in_splits: list, stats: Counter,
                  name: str) -> torch.Tensor:
    if comm.size == 1:
        return x
    return _AllToAllSingleFn.apply(x, comm, out_splits, in_splits, stats, name)


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """A SwiGLU expert on [in, out] matrices (the expert MLP of Mixtral and DeepSeek)."""
    return (F.silu(x @ gate) * (x @ up)) @ down


# the activations Hugging Face's ACT2FN gives MoE experts (config.hidden_act)
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "relu": F.relu}


@dataclass(frozen=True)
class ExpertForm:
    """How one expert computes from its weights; ``str(form)`` is the usc::moe op's ``form`` argument
    and ``ExpertForm.parse`` reads it back.

    ``swiglu``: gate, up, down as [in, out] matrices (``nn.Linear`` experts, usc's stacked [E, in, out]).
    ``fused``: the transformers-5 stacked layout, per expert ``gate_up`` [2F, H] and ``down`` [H, F]
    (``transposed``: [H, 2F] and [F, H], GPT-OSS), the two halves of gate_up concatenated
    ([gate; up]) or ``interleaved`` (gate0, up0, gate1, ...), optional ``bias`` [2F] and [H];
    ``limit`` > 0 is GPT-OSS's clamped gate: gate <= limit, |up| <= limit,
    out = (up + 1) * gate * sigmoid(alpha * gate).
    """

    kind: str = "swiglu"  # "swiglu" | "fused"
    act: str = "silu"
    interleaved: bool = False
    transposed: bool = False
    bias: bool = False
    alpha: float = 1.0
    limit: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("swiglu", "fused") or self.act not in ACTIVATIONS:
            raise ValueError(f"unknown expert form {self!r}")

    def __str__(self) -> str:
        return ",".join(f"{k}={v}" for k, v in self.__dict__.items())

    @staticmethod
    def parse(text: str) -> "ExpertForm":
        fields = dict(item.split("=") for item in text.split(",")) if "=" in text else {"kind": text}
        kinds = {"kind": str, "act": str, "interleaved": _flag, "transposed": _flag, "bias": _flag,
                 "alpha": float, "limit": float}
        return ExpertForm(**{k: kinds[k](v) for k, v in fields.items()})

    @property
    def tensors_per_expert(self) -> int:
        return 3 if self.kind == "swiglu" else 2 + 2 * self.bias

    def __call__(self, x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        """One expert on its rows ``x`` [n, H] (weights as the form lays them out)."""
        if self.kind == "swiglu":
            return swiglu(x, *weights)
        gate_up, down, *bias = weights
        h = x @ gate_up if self.transposed else x @ gate_up.t()
        h = h + bias[0] if self.bias else h
        gate, up = (h[..., ::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        y = self._glu(gate, up)
        y = y @ down if self.transposed else y @ down.t()
        return y + bias[1] if self.bias else y

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.limit > 0:  # GPT-OSS (modeling_gpt_oss.GptOssExperts._apply_gate)
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return ACTIVATIONS[self.act](gate) * up


def _flag(text: str) -> bool:
    return text == "True"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def balanced_counts(rows: int, ep: int, local: int) -> list[list[int]]:
    """Assignments spread evenly over ep ranks x local experts (shapes for fake-tensor runs)."""
    cells = ep * local
    flat = [rows // cells + (1 if i < rows % cells else 0) for i in range(cells)]
    return [flat[r * local:(r + 1) * local] for r in range(ep)]


class ExpertParallelMoE(CollectiveNode):
    """Routed experts over the ``ep`` axis (see the module docstring).

    Inputs: hidden x [..., H], router weights and expert indices [..., k], then the expert weights:
    ``stacked``: one [E_local, ...] tensor per weight of ``form`` (SwiGLU: gate, up [E_local, H, F] and
    down [E_local, F, H]; fused: gate_up, down and their biases, see ``ExpertForm``);
    otherwise E gate, E up, E down ``nn.Linear`` weights ([F, H], [F, H], [H, F]), of which this rank
    uses its E/ep. Under tp each expert's F is split: the output is then a partial sum.
    ``capacity``: assignments kept per expert (None: dropless); ``token_axes``: the mesh axes that
    split the tokens along dim 0, outer first (the global token order for dropping).
    """

    kind = "all-to-all"
    traffic_input = 0  # the report sizes the exchanges from x

    def __init__(self, axis: str = "ep", *, num_experts: int, top_k: int, stacked: bool,
                 capacity: int | None = None, token_axes: tuple[str, ...] = (), path: str = "",
                 form: ExpertForm = ExpertForm()) -> None:
        super().__init__(axis)
        self.num_experts, self.top_k, self.stacked, self.form = num_experts, top_k, stacked, form
        self.capacity, self.token_axes = capacity, tuple(token_axes)
        self.path = path
        self._token_comms: list[Comm] = []
        self.reset_stats()

    def reset_stats(self) -> None:
        """Start counting a new step: bytes sent by the exchanges, rows received per local expert."""
        self.stats: Counter = Counter()
        self.load: list[int] = []

    def bind(self, mesh: Mesh) -> ExpertParallelMoE:
        super().bind(mesh)
        self._token_comms = [mesh.comm(a) for a in self.token_axes]
        return self

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state["_token_comms"] = []
        return state

    def extra_repr(self) -> str:
        return (f"axis={self.axis!r}, num_experts={self.num_experts}, top_k={self.top_k}, stacked={self.stacked}"
                + (f", form={self.form}" if self.form != ExpertForm() else "")
                + (f", capacity={self.capacity}, token_axes={self.token_axes}" if self.capacity else ""))

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.comm.size

    # ------------------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, *experts: torch.Tensor):
        hidden = x.shape[-1]
        flat, w = x.reshape(-1, hidden), weights.reshape(-1, self.top_k)
        expert = indices.reshape(-1)  # assignment a = token * k + slot
        order, counts = self._route(expert)
        send, recv, recv_counts = self._exchange_counts(counts, expert)
        order = order[: sum(map(sum, send))]  # dropped assignments (capacity) sort last
        # Each buffer of T*k rows is let go once the next exists: recomputation (recompute=full)
        # stops at the last tensor backward needs, inside this forward, and every buffer still named
        # here at that moment stays alive through the block's backward (measured: a fifth of a
        # Mixtral block's recomputation peak).
        rows = flat.index_select(0, torch.div(order, self.top_k, rounding_mode="floor"))
        got = exchange_rows(rows, self.comm, [sum(r) for r in recv], [sum(s) for s in send], self.stats, "dispatch")
        del rows
        perm, sizes = self._grouping(got, recv, recv_counts)
        grouped = got.index_select(0, perm)
        del got
        y = self._run_experts(grouped, perm, sizes, experts)
        del grouped
        back = exchange_rows(y, self.comm, [sum(s) for s in send], [sum(r) for r in recv], self.stats, "combine")
        del y
        # each kept assignment's row to its slot (``order`` holds no index twice; a dropped slot stays
        # zero): index_put_ saves only the index for backward, index_add would save ``back`` too
        slots = flat.new_zeros(expert.numel(), back.shape[-1]).index_put_((order,), back)
        del back
        out = (slots.view(-1, self.top_k, slots.shape[-1]) * w.unsqueeze(-1).to(slots.dtype)).sum(1)
        return out.view(*x.shape[:-1], out.shape[-1]) + self._anchor(experts)

    def _route(self, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(assignments sorted by (expert, token order), the kept ones first; kept rows per expert,
        on the device: None for fake tensors, which have no counts)."""
        if _is_fake(expert):
            return torch.arange(expert.numel(), device=expert.device), None
        kept = self._kept(expert)
        key = expert * expert.numel() + torch.arange(expert.numel(), device=expert.device)
        if kept is not None:
            key = torch.where(kept, key, self.num_experts * expert.numel())  # dropped: last
        order = torch.argsort(key, stable=True)
        # a scatter, not bincount or boolean indexing: both size their output from the data (a host sync)
        ones = kept.to(torch.int64) if kept is not None else torch.ones_like(expert)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=expert.device).scatter_add_(0, expert, ones)
        return order, counts

    def _exchange_counts(self, counts: torch.Tensor | None, expert: torch.Tensor) -> tuple[list, list, torch.Tensor]:
        """(rows I send, rows each peer sends me, per [peer][local expert]; the latter on the device).
        The counts are exchanged on the device and read on the host once per layer: the uneven
        all-to-all takes its split sizes on the host (NCCL, as Megatron's all-to-all dispatcher)."""
        ep, local = self.comm.size, self.num_experts // self.comm.size
        if counts is None:
            balanced = balanced_counts(expert.numel(), ep, local)
            return balanced, balanced, None
        got = counts if ep == 1 else self.comm.all_to_all_single(counts, [local] * ep, [local] * ep)
        send, recv = torch.stack([counts, got]).view(2, ep, local).tolist()  # the layer's one host sync
        return send, recv, got

    def _kept(self, expert: torch.Tensor) -> torch.Tensor | None:
        """Capacity: an assignment is kept if fewer than C assignments to its expert come before it
        in global token order (earlier token shards first, then earlier tokens of this shard)."""
        if self.capacity is None:
            return None
        onehot = expert.unsqueeze(1) == torch.arange(self.num_experts, device=expert.device)
        position = onehot.cumsum(0).gather(1, expert.unsqueeze(1)).squeeze(1) - 1
        before = self._earlier_shards(onehot.sum(0))
        return before[expert] + position < self.capacity

    def _earlier_shards(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-expert assignments held by the token shards before this one (dim-0 chunk order)."""
        table, mine = counts.unsqueeze(0), 0
        for comm in reversed(self._token_comms):  # innermost axis varies fastest in the chunk order
            table = comm.all_gather(table.unsqueeze(0), 0).flatten(0, 1)
        for comm in self._token_comms:
            mine = mine * comm.size + comm.rank
        return table[:mine].sum(0)

    def _grouping(self, rows: torch.Tensor, recv: list[list[int]], recv_counts: torch.Tensor | None
                  ) -> tuple[torch.Tensor, list[int]]:
        """(the permutation grouping the received rows by local expert, rows per local expert). The
        row -> expert map is built from the counts on the device (output size known: no sync)."""
        local = len(recv[0])
        experts_of_rows = torch.arange(local, device=rows.device).repeat(len(recv))  # peer-major, as received
        segment = torch.repeat_interleave(experts_of_rows, recv_counts.reshape(-1), output_size=rows.shape[0]) \
            if recv_counts is not None else torch.arange(rows.shape[0], device=rows.device) % local
        sizes = [sum(per_peer[e] for per_peer in recv) for e in range(local)]
        self.load = [a + b for a, b in zip(self.load, sizes)] if self.load else sizes
        return torch.argsort(segment, stable=True), sizes

    def _run_experts(self, grouped: torch.Tensor, perm: torch.Tensor, sizes: list[int],
                     experts) -> torch.Tensor:
        """Run each local expert on its rows of ``grouped`` and write its output straight to the rows'
        received order (``y[perm[j]]`` is row j's output): one output buffer, not a concatenation of
        the experts' outputs and then a permuted copy of it."""
        y = None
        for e, (chunk, where) in enumerate(zip(grouped.split(sizes), perm.split(sizes))):
            out = self.form(chunk, *self._weights(experts, e))
            if y is None:
                y = out.new_empty(grouped.shape[0], out.shape[-1])
            y.index_put_((where,), out)  # saves the index only (index_copy_ would save ``out``)
            del out  # before the next expert's output exists
        return y  # every rank holds one local expert at least (ep divides the experts)

    def _weights(self, experts, e: int) -> tuple[torch.Tensor, ...]:
        """Local expert e's weights as its form takes them (stacked: row e of each [E_local, ...] tensor)."""
        if self.stacked:
            return tuple(t[e] for t in experts)
        n = self.num_experts
        first = self.comm.rank * self.local_experts + e
        return experts[first].t(), experts[n + first].t(), experts[2 * n + first].t()

    def _anchor(self, experts) -> torch.Tensor | float:
        """Zero that depends on the experts this rank does not run (``nn.Linear`` experts under ep), so
        every rank produces a gradient (zeros) for every parameter, as the bucketed reducer expects."""
        if self.stacked or self.comm.size == 1:
            return 0.0
        n, mine = self.num_experts, range(self.comm.rank * self.local_experts, (self.comm.rank + 1) * self.local_experts)
        others = [experts[k * n + e] for k in range(3) for e in range(n) if e not in mine]
        return sum(t.reshape(-1)[0] for t in others) * 0.0

    @staticmethod
    def global_fn(x: torch.Tensor, *rest) -> torch.Tensor:
        """The global value's shape: the output is shaped like the hidden states."""
        return torch.empty_like(x)

    # ---------------------------------------------------------------------------- reporting
    def forward_collective(self) -> str | None:
        return "all-to-all"

    def backward_collective(self) -> str | None:
        return "all-to-all"

    def traffic(self, shape: tuple[int, ...], dtype: torch.dtype, n: int) -> list[tuple]:
        """The two exchanges per direction (dispatch, combine), assuming balanced dropless routing:
        T*k rows of H leave each rank (the rows for its own experts included)."""
        del n
        tokens = 1
        for s in shape[:-1]:
            tokens *= s
        rows = (tokens * self.top_k, shape[-1])
        nbytes = rows[0] * rows[1] * torch.empty((), dtype=dtype).element_size()
        what = {"dispatch": "MoE dispatch: token rows to their experts' ranks (counts exchanged first)",
                "combine": "MoE combine: expert outputs back to their tokens' ranks"}
        return [(direction, "all-to-all", rows, nbytes, 1, f"{what[step]}{' (gradient)' if back else ''}")
                for direction, back in (("forward", False), ("backward", True))
                for step in (("dispatch", "combine") if not back else ("combine", "dispatch"))]


# ================================================================================ statistics
@dataclass(frozen=True)
class MoEStats:
    """One MoE layer over one step, gathered from every rank.

    tokens_per_expert: rows each expert processed (summed over the replicas that hold it);
    tokens_per_rank: rows each rank's experts processed (the load, indexed by global rank);
    imbalance: max / mean of tokens_per_expert (1.0 = perfectly balanced);
    rank_imbalance: max / mean of tokens_per_rank;
    all_to_all_bytes: per rank, bytes this rank handed to each exchange ('dispatch forward', ...).
    """

    tokens_per_expert: tuple[int, ...]
    tokens_per_rank: tuple[int, ...]
    imbalance: float
    rank_imbalance: float
    all_to_all_bytes: tuple[dict, ...]


def rank_stats(gm: torch.nn.Module, mesh) -> dict[str, dict]:
    """This rank's view of every MoE layer it ran: its experts' loads and its exchange bytes."""
    out = {}
    for module in gm.modules():
        if isinstance(module, ExpertParallelMoE) and module.load:
            first = module.comm.rank * module.local_experts
            out[module.path] = {"first": first, "load": list(module.load), "bytes": dict(module.stats),
                                "counted": mesh.coord_of("tp") == 0,
                                "experts": module.num_experts}
    return out


def summarize(per_rank: list[dict[str, dict]]) -> dict[str, MoEStats]:
    """Combine every rank's view (``rank_stats``): tp ranks repeat their group's work, so only
    tp rank 0 is counted in the loads."""
    paths = sorted({p for view in per_rank for p in view})
    result = {}
    for path in paths:
        views = [view.get(path) for view in per_rank]
        experts = next(v["experts"] for v in views if v)
        per_expert, per_rank_load = [0] * experts, []
        for v in views:
            counted = v is not None and v["counted"]
            per_rank_load.append(sum(v["load"]) if v else 0)
            for i, n in enumerate(v["load"] if counted else []):
                per_expert[v["first"] + i] += n
        result[path] = MoEStats(tuple(per_expert), tuple(per_rank_load), _ratio(per_expert), _ratio(per_rank_load),
                                tuple(v["bytes"] if v else {} for v in views))
    return result


def _ratio(values: list[int]) -> float:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean else 1.0
