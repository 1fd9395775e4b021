"""Mixture-of-experts blocks: recognised on the ``nn.Module`` level and traced as ONE opaque node.

A dropless MoE written in plain PyTorch routes with ``torch.where`` / ``nonzero`` per expert, whose
shapes depend on the data, so ``torch.export`` cannot give them static shapes. usc therefore finds
MoE blocks *before* tracing and, while tracing, swaps each block's forward for an equivalent one:
the router (a linear layer, softmax or sigmoid, top-k) stays ordinary traced ops — so a load
balancing loss computed from the router outputs is traced like any other code — and the dispatch,
the experts and the weighted combine become one ``usc::moe`` node. Passes replace that node by the
runtime's expert-parallel module (all-to-all dispatch and combine).

Patterns recognised (the tables below):
  * router: a ``nn.Linear`` child named ``gate`` or ``router`` with ``num_experts`` outputs;
    ``top_k`` / ``num_experts_per_tok`` attribute; softmax then top-k (optionally renormalised) or
    sigmoid then top-k (optionally renormalised);
  * experts: a ``ModuleList`` ``experts`` of SwiGLU MLPs (``w1``/``w3``/``w2`` or
    ``gate_proj``/``up_proj``/``down_proj`` linears without bias), or stacked expert weights of
    those names shaped ``[E, in, out]``;
  * an optional shared expert (``shared_expert`` / ``shared_experts``) added to the routed output;
  * the block returns the output, or ``(output, router_logits)`` (Mixtral's convention).
Which routing variant a block computes is decided by running the candidates against the block's
own forward on a random input: a block is replaced only by a forward that reproduces it.
A plan rule ``path: expert`` marks a block whose names differ (``describe_marked``: the structure is
found by shapes, not names); it must still verify.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

ROUTER_NAMES = ("gate", "router")
TOP_K_NAMES = ("top_k", "num_experts_per_tok")
EXPERT_LIST_NAMES = ("experts",)
SHARED_NAMES = ("shared_expert", "shared_experts")
WEIGHT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # (gate, up, down)
SCORINGS = ("softmax", "sigmoid")


# ================================================================= the opaque op traced in the graph
@torch.library.custom_op("usc::moe", mutates_args=())
def moe(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, gate: list[torch.Tensor],
        up: list[torch.Tensor], down: list[torch.Tensor], stacked: bool) -> torch.Tensor:
    """Dropless routed SwiGLU experts: out[t] = sum_j weights[t, j] * expert_{indices[t, j]}(x[t]).

    ``gate``/``up``/``down``: one weight per expert as ``nn.Linear`` stores it ([out, in]), or with
    ``stacked`` one tensor each of shape [E, in, out]. Token dims are all dims but the last."""
    hidden = x.shape[-1]
    flat, w, idx = x.reshape(-1, hidden), weights.reshape(idx_rows(indices), -1), indices.reshape(-1, indices.shape[-1])
    out = torch.zeros_like(flat)
    for e in range(num_experts(gate, stacked)):
        token, slot = torch.where(idx == e)
        if token.numel():
            y = swiglu(flat[token], *expert_weights(gate, up, down, stacked, e)) * w[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    return out.view_as(x)


@moe.register_fake
def _moe_fake(x, weights, indices, gate, up, down, stacked):
    return torch.empty_like(x)


def idx_rows(indices: torch.Tensor) -> int:
    return indices.numel() // indices.shape[-1]


def num_experts(gate: list[torch.Tensor], stacked: bool) -> int:
    return gate[0].shape[0] if stacked else len(gate)


def expert_weights(gate, up, down, stacked: bool, e: int) -> tuple[torch.Tensor, ...]:
    """Expert e's (gate, up, down) as [in, out] matrices (x @ w)."""
    if stacked:
        return gate[0][e], up[0][e], down[0][e]
    return gate[e].t(), up[e].t(), down[e].t()


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate) * (x @ up)) @ down


# ============================================================================ the recognised block
@dataclass(frozen=True)
class Routing:
    """How a router turns logits into top-k weights."""

    scoring: str  # "softmax" | "sigmoid"
    normalize: bool  # the k weights are divided by their sum

    def __call__(self, logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softmax(logits, dim=-1, dtype=torch.float) if self.scoring == "softmax" \
            else torch.sigmoid(logits.float())
        weights, indices = torch.topk(scores, k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


@dataclass(frozen=True)
class MoEBlock:
    """One recognised block: where its parts are, and the forward that reproduces it."""

    path: str
    router: str
    experts: str  # the ModuleList child, or "" for stacked weights on the block itself
    names: tuple[str, str, str]  # (gate, up, down) weight names
    shared: str
    top_k: int
    num_experts: int
    routing: Routing | None = None
    returns_logits: bool = False
    flat_logits: bool = False  # router logits returned as [tokens, E]
    verified: bool = False

    @property
    def stacked(self) -> bool:
        return not self.experts


class MoEPatternError(ValueError):
    """A module marked ``expert`` (or looking like an MoE block) that usc cannot reproduce."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"module '{path}': {reason}")
        self.path, self.reason = path, reason


def _child(module: nn.Module, names, kind) -> str:
    return next((n for n in names if isinstance(getattr(module, n, None), kind)), "")


def _top_k(module: nn.Module) -> int | None:
    for name in TOP_K_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _list_names(experts: nn.ModuleList) -> tuple[str, str, str] | None:
    for names in WEIGHT_NAMES:
        if all(all(isinstance(getattr(e, n, None), nn.Linear) for n in names) for e in experts):
            return names
    return None


def _stacked_names(module: nn.Module, count: int) -> tuple[str, str, str] | None:
    for names in WEIGHT_NAMES:
        params = [getattr(module, n, None) for n in names]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 and p.shape[0] == count for p in params):
            return names
    return None


def describe(module: nn.Module, path: str) -> list[MoEBlock] | str:
    """The block's structure (by the name tables), or why it is not a recognisable MoE block."""
    router = _child(module, ROUTER_NAMES, nn.Linear)
    if not router:
        return f"no router: expected an nn.Linear child named {' or '.join(ROUTER_NAMES)}"
    count = getattr(module, router).out_features
    k = _top_k(module)
    if k is None:
        return f"no top-k: expected an int attribute {' or '.join(TOP_K_NAMES)}"
    experts = _child(module, EXPERT_LIST_NAMES, nn.ModuleList)
    names = _list_names(getattr(module, experts)) if experts else _stacked_names(module, count)
    if names is None:
        return ("no experts: expected a ModuleList 'experts' of SwiGLU MLPs or stacked [E, in, out] weights "
                f"named {' / '.join(str(n) for n in WEIGHT_NAMES)}")
    if experts and len(getattr(module, experts)) != count:
        return f"the router has {count} outputs but there are {len(getattr(module, experts))} experts"
    if experts and any(getattr(e, n).bias is not None for e in getattr(module, experts) for n in names):
        return "expert linears with a bias are not supported"
    return [MoEBlock(path, router, experts, names, _child(module, SHARED_NAMES, nn.Module), k, count)]


def describe_marked(module: nn.Module, path: str) -> list[MoEBlock] | str:
    """A block a plan rule marks ``expert``: any names. The experts are the one ModuleList of modules
    with three bias-free linears (or three stacked 3-D weights with equal first dims); the router
    the linear with one output per expert; top-k an int attribute. Which weight is gate, up and
    down is left to verification (every order is a candidate)."""
    found = describe(module, path)
    if not isinstance(found, str):
        return found
    k = next((v for n, v in vars(module).items()
              if isinstance(v, int) and not isinstance(v, bool) and "k" in n.lower() and v > 0), None)
    if k is None:
        return "no top-k: expected an int attribute whose name has a 'k' (top_k, num_experts_per_tok, k, ...)"
    experts, names, count = _any_experts(module)
    if not names:
        return "no experts: expected a ModuleList of modules with three bias-free nn.Linear, or three [E, ...] weights"
    routers = [n for n, c in module.named_children() if isinstance(c, nn.Linear) and c.out_features == count]
    if len(routers) != 1:
        return f"no router: expected exactly one nn.Linear child with {count} outputs (one per expert)"
    shared = next((n for n, c in module.named_children() if n not in (experts, routers[0])
                   and any(True for _ in c.parameters())), "")
    return [MoEBlock(path, routers[0], experts, order, extra, k, count)
            for extra in dict.fromkeys(("", shared)) for order in itertools.permutations(names)]


def _any_experts(module: nn.Module) -> tuple[str, tuple[str, ...], int]:
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList) and len(child):
            linears = [n for n, c in child[0].named_children() if isinstance(c, nn.Linear) and c.bias is None]
            if len(linears) == 3 and all(all(isinstance(getattr(e, n, None), nn.Linear) for n in linears)
                                         for e in child):
                return name, tuple(linears), len(child)
    stacked = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if len(stacked) == 3 and len({getattr(module, n).shape[0] for n in stacked}) == 1:
        return "", tuple(stacked), getattr(module, stacked[0]).shape[0]
    return "", (), 0


def expert_tensors(module: nn.Module, block: MoEBlock) -> tuple[list, list, list]:
    if block.stacked:
        return tuple([getattr(module, n)] for n in block.names)
    experts = getattr(module, block.experts)
    return tuple([getattr(e, n).weight for e in experts] for n in block.names)


def block_forward(module: nn.Module, block: MoEBlock):
    """The forward usc traces in place of the block's own: router ops, one usc::moe node, shared expert."""
    def forward(x: torch.Tensor, *args, **kwargs):
        logits = getattr(module, block.router)(x)
        weights, indices = block.routing(logits, block.top_k)
        out = torch.ops.usc.moe(x, weights.to(x.dtype), indices, *expert_tensors(module, block), block.stacked)
        if block.shared:
            out = out + getattr(module, block.shared)(x)
        if not block.returns_logits:
            return out
        return out, (logits.reshape(-1, block.num_experts) if block.flat_logits else logits)
    return forward


# ============================================================================= verification
def _probe(module: nn.Module, block: MoEBlock) -> torch.Tensor:
    param = next(module.parameters())
    hidden = getattr(module, block.router).in_features
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(2, 5, hidden, generator=gen).to(device=param.device, dtype=param.dtype)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=1e-4, atol=1e-5)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    return False


def _candidates(blocks: list[MoEBlock], expected) -> list[MoEBlock]:
    returns = isinstance(expected, (tuple, list))
    flat = returns and len(expected) > 1 and isinstance(expected[1], torch.Tensor) and expected[1].dim() == 2
    return [MoEBlock(**{**block.__dict__, "routing": Routing(s, n), "returns_logits": returns,
                        "flat_logits": flat, "verified": True})
            for block in blocks for s, n in itertools.product(SCORINGS, (False, True))]


@torch.no_grad()
def verify(module: nn.Module, blocks: list[MoEBlock]) -> MoEBlock:
    """The structure and routing variant whose forward reproduces the block's own on a random input."""
    block = blocks[0]
    if next(module.parameters()).device.type == "meta":  # nothing to run: assume Mixtral's routing
        return MoEBlock(**{**block.__dict__, "routing": Routing("softmax", False)})
    x = _probe(module, block)
    try:
        expected = module(x)
    except Exception as exc:  # noqa: BLE001 - the user's block failing on a probe is a pattern failure
        raise MoEPatternError(block.path, f"its forward failed on a [2, 5, hidden] probe: {exc}") from exc
    for candidate in _candidates(blocks, expected):
        try:
            if _same(block_forward(module, candidate)(x), expected):
                return candidate
        except RuntimeError:  # a weight order whose shapes do not chain
            continue
    raise MoEPatternError(block.path, "no routing usc knows (softmax or sigmoid, then top-k, optionally "
                                      "renormalised; SwiGLU experts) reproduces its forward")


def find_blocks(model: nn.Module, marked: frozenset[str] = frozenset()) -> list[MoEBlock]:
    """Every MoE block of ``model`` (outermost first), verified; ``marked`` paths must be blocks."""
    found: list[MoEBlock] = []
    for path, module in model.named_modules():
        if any(path.startswith(b.path + ".") for b in found):
            continue
        shape = describe_marked(module, path) if path in marked else describe(module, path)
        if isinstance(shape, str):
            if path in marked:
                raise MoEPatternError(path, shape)
            continue
        found.append(verify(module, shape))
    return found


@contextlib.contextmanager
def patched(model: nn.Module, blocks: list[MoEBlock]):
    """Each block's forward swapped for its usc::moe form while tracing."""
    modules = dict(model.named_modules())
    for block in blocks:
        modules[block.path].forward = block_forward(modules[block.path], block)
    try:
        yield
    finally:
        for block in blocks:
            del modules[block.path].forward


__all__ = ["MoEBlock", "MoEPatternError", "Routing", "find_blocks", "patched", "moe", "swiglu", "expert_weights"]
