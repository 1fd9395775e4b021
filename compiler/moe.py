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
import inspect
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from usc.runtime.moe import ACTIVATIONS, ExpertForm

from .errors import TraceError

ROUTER_NAMES = ("gate", "router")
TOP_K_NAMES = ("top_k", "num_experts_per_tok")
EXPERT_LIST_NAMES = ("experts",)
SHARED_NAMES = ("shared_expert", "shared_experts")
WEIGHT_NAMES = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))  # (gate, up, down)
SCORINGS = ("softmax", "sigmoid")


# ================================================================= the opaque op traced in the graph
@torch.library.custom_op("usc::moe", mutates_args=())
def moe(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, experts: list[torch.Tensor],
        stacked: bool, form: str) -> torch.Tensor:
    """Dropless routed experts: out[t] = sum_j weights[t, j] * expert_{indices[t, j]}(x[t]).

    ``experts``: with ``stacked`` one [E, ...] tensor per weight of the expert ``form``
    (``runtime.moe.ExpertForm``: SwiGLU gate, up, down [E, in, out]; or transformers-5 gate_up, down
    and biases); otherwise E gate, E up, E down weights as ``nn.Linear`` stores them ([out, in]).
    Token dims are all dims but the last."""
    hidden, expert = x.shape[-1], ExpertForm.parse(form)
    flat, w, idx = x.reshape(-1, hidden), weights.reshape(idx_rows(indices), -1), indices.reshape(-1, indices.shape[-1])
    out = torch.zeros_like(flat)
    for e in range(num_experts(experts, stacked)):
        token, slot = torch.where(idx == e)
        if token.numel():
            y = expert(flat[token], *expert_weights(experts, stacked, e)) * w[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
    return out.view_as(x)


@moe.register_fake
def _moe_fake(x, weights, indices, experts, stacked, form):
    return torch.empty_like(x)


def idx_rows(indices: torch.Tensor) -> int:
    return indices.numel() // indices.shape[-1]


def num_experts(experts: list[torch.Tensor], stacked: bool) -> int:
    return experts[0].shape[0] if stacked else len(experts) // 3


def expert_weights(experts: list[torch.Tensor], stacked: bool, e: int) -> tuple[torch.Tensor, ...]:
    """Expert e's weights as its form takes them (``nn.Linear`` experts: (gate, up, down) as [in, out])."""
    if stacked:
        return tuple(t[e] for t in experts)
    n = len(experts) // 3
    return experts[e].t(), experts[n + e].t(), experts[2 * n + e].t()


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


def expert_tensors(module: nn.Module, block: MoEBlock) -> list[torch.Tensor]:
    """The usc::moe op's flat expert list: stacked gate, up, down; or every expert's gate, up, down."""
    if block.stacked:
        return [getattr(module, n) for n in block.names]
    experts = getattr(module, block.experts)
    return [getattr(e, n).weight for n in block.names for e in experts]


def block_forward(module: nn.Module, block: MoEBlock):
    """The forward usc traces in place of the block's own: router ops, one usc::moe node, shared expert."""
    def forward(x: torch.Tensor, *args, **kwargs):
        logits = getattr(module, block.router)(x)
        weights, indices = block.routing(logits, block.top_k)
        out = torch.ops.usc.moe(x, weights.to(x.dtype), indices, expert_tensors(module, block), block.stacked,
                                str(ExpertForm()))
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


def _error(a, b) -> float:
    """Largest difference relative to the size of the expected output (inf when shapes differ).

    Relative, not absolute: with small expert weights a block's output is ~1e-4, and an absolute
    tolerance would accept a wrong variant (w1 and w3 swapped, say) whose output is also tiny."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return float("inf")
        scale = b.double().abs().max().item() or 1.0
        return (a.double() - b.double()).abs().max().item() / scale
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return max((_error(x, y) for x, y in zip(a, b)), default=0.0)
    return float("inf")


def _tolerance(dtype: torch.dtype) -> float:
    # the routers score in float32; half-precision blocks round their own forward much more
    return 5e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-4


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
    scored = []
    for candidate in _candidates(blocks, expected):
        try:
            scored.append((_error(block_forward(module, candidate)(x), expected), len(scored), candidate))
        except RuntimeError:  # a weight order whose shapes do not chain
            continue
    if scored and min(scored)[0] <= _tolerance(x.dtype):
        return min(scored)[2]  # the closest variant: several can fall within rounding of tiny outputs
    raise MoEPatternError(block.path, "no routing usc knows (softmax or sigmoid, then top-k, optionally "
                                      "renormalised; SwiGLU experts) reproduces its forward")


# ====================================================== transformers-5 experts modules (router kept)
@dataclass(frozen=True)
class ExpertsModule:
    """Experts called as ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` with
    stacked ``gate_up_proj`` / ``down_proj`` weights (and biases): the layout of every MoE family of
    transformers 5 (Mixtral, Qwen2/3-MoE, DeepSeek-V3, GPT-OSS, ...). Only this module becomes the
    usc::moe node; the router, shared experts and their gates stay the model's own traced code, so
    every routing rule (softmax or sigmoid, renormalised, group-limited with a correction bias,
    routed_scaling_factor) is computed exactly as the model writes it."""

    path: str
    names: tuple[str, ...]  # gate_up, down[, gate_up bias, down bias]
    num_experts: int
    form: ExpertForm
    verified: bool = False


EXPERTS_WEIGHTS = ("gate_up_proj", "down_proj")
EXPERTS_BIASES = ("gate_up_proj_bias", "down_proj_bias")


def _stacked_param(module: nn.Module, name: str, dims: int) -> torch.Tensor | None:
    # the registered parameter itself: getattr would run a parametrization (spectral_norm's power
    # iteration writes its buffers in place: looking at the model would change it)
    value = module._parameters.get(name)
    return value if isinstance(value, nn.Parameter) and value.dim() == dims else None


def describe_experts(module: nn.Module, path: str) -> list[ExpertsModule] | str:
    """The candidate forms of a transformers-5 experts module, or why it is not one."""
    gate_up, down = (_stacked_param(module, n, 3) for n in EXPERTS_WEIGHTS)
    if gate_up is None or down is None or gate_up.shape[0] != down.shape[0]:
        return f"no experts: expected stacked 3-D parameters {' and '.join(EXPERTS_WEIGHTS)}"
    if len(inspect.signature(module.forward).parameters) < 3:
        return "no experts: expected forward(hidden, top_k_index, top_k_weights)"
    biases = tuple(n for n in EXPERTS_BIASES if _stacked_param(module, n, 2) is not None)
    if biases not in ((), EXPERTS_BIASES):
        return f"only one of the biases {' and '.join(EXPERTS_BIASES)}"
    layouts = [t for t in (False, True) if _chains(gate_up.shape, down.shape, t)]
    if not layouts:
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} do not chain"
    glus = [{"limit": float(module.limit), "alpha": float(module.alpha)}] if _clamped(module) \
        else [{"act": a} for a in ACTIVATIONS]
    return [ExpertsModule(path, EXPERTS_WEIGHTS + biases, gate_up.shape[0],
                          ExpertForm("fused", interleaved=i, transposed=t, bias=bool(biases), **glu))
            for t in layouts for i in (False, True) for glu in glus]


def _chains(gate_up: torch.Size, down: torch.Size, transposed: bool) -> bool:
    """[E, 2F, H] with [E, H, F]; transposed [E, H, 2F] with [E, F, H]."""
    (_, a, b), (_, c, d) = gate_up, down
    return (b == c and a == 2 * d) if not transposed else (a == d and b == 2 * c)


def _clamped(module: nn.Module) -> bool:
    """GPT-OSS's experts carry the clamp ``limit`` and the sigmoid's ``alpha``."""
    return all(isinstance(vars(module).get(n), (int, float)) for n in ("limit", "alpha"))


def _hidden_size(block: ExpertsModule, module: nn.Module) -> int:
    down = getattr(module, block.names[1])
    return down.shape[2] if block.form.transposed else down.shape[1]


def experts_forward(module: nn.Module, block: ExpertsModule):
    """The forward usc traces in place of the experts module's own: one usc::moe node."""
    def forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        tensors = [getattr(module, n) for n in block.names]
        return torch.ops.usc.moe(hidden, top_k_weights.to(hidden.dtype), top_k_index, tensors, True,
                                 str(block.form))
    return forward


@torch.no_grad()
def verify_experts(module: nn.Module, blocks: list[ExpertsModule]) -> ExpertsModule:
    """The form whose expert computation reproduces the module's own forward on random routing."""
    if next(module.parameters()).device.type == "meta":  # nothing to run: the first layout that chains
        return blocks[0]
    scored, failures = [], []
    for candidate in blocks:
        x, index, weights = _experts_probe(module, candidate)
        try:
            expected = module(x, index, weights)
        except Exception as exc:  # noqa: BLE001 - a hidden size this layout guessed wrong
            failures.append(exc)
            continue
        got = experts_forward(module, candidate)(x, index, weights)
        scored.append((_error(got, expected), len(scored), candidate))
    if scored and min(scored)[0] <= _tolerance(next(module.parameters()).dtype):
        return ExpertsModule(**{**min(scored)[2].__dict__, "verified": True})
    if not scored and failures:  # the module's own forward refuses every probe: say why, not "no form"
        dtype = str(next(module.parameters()).dtype).removeprefix("torch.")
        raise MoEPatternError(blocks[0].path, f"its own forward fails on a probe of its {dtype} weights "
                                              f"({type(failures[-1]).__name__}: {failures[-1]}), so usc cannot check "
                                              "which expert form it computes")
    raise MoEPatternError(blocks[0].path, "no expert form usc knows (gate_up / down, concatenated or interleaved "
                                          "halves, an activation of " + ", ".join(ACTIVATIONS)
                                          + " or GPT-OSS's clamped gate) reproduces its forward")


def _experts_probe(module: nn.Module, block: ExpertsModule) -> tuple[torch.Tensor, ...]:
    """7 random tokens, each routed to min(2, E) distinct experts with random weights."""
    param = next(module.parameters())
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(7, _hidden_size(block, module), generator=gen)
    index = torch.rand(7, block.num_experts, generator=gen).argsort(-1)[:, :min(2, block.num_experts)]
    weights = torch.rand(index.shape, generator=gen)
    return x.to(param.device, param.dtype), index.to(param.device), weights.to(param.device, param.dtype)


# ========================================================== transformers-5 router modules
@dataclass(frozen=True)
class RouterRule:
    """How a router module turns hidden states into (logits, top-k weights, top-k indices).

    scoring: ``softmax`` / ``sigmoid`` of all logits, then top-k (of the scores plus the module's
    correction bias, within the best ``groups`` limited to ``topk_group``: DeepSeek-V3); or
    ``topk_softmax``: top-k of the logits, softmax over the k (GPT-OSS). Then optionally
    renormalised, and multiplied by ``scale`` (routed_scaling_factor)."""

    scoring: str
    normalize: bool
    float_logits: bool  # logits computed in float32 whatever the model's dtype (DeepSeek-V3)
    groups: int = 1
    topk_group: int = 1
    scale: float = 1.0


@dataclass(frozen=True)
class RouterModule:
    """A router module with a ``weight`` [E, H] (and optional bias) returning (logits, weights,
    indices), replaced by ``rule`` written in ops every plan shards (its own forward writes in
    place and scatters). Verified against the module's own forward like every block."""

    path: str
    num_experts: int
    top_k: int
    rule: RouterRule
    correction: str = ""  # the buffer added to the scores before choosing (DeepSeek-V3)
    verified: bool = False


ROUTER_SCORINGS = ("softmax", "sigmoid", "topk_softmax")
CORRECTION_NAMES = ("e_score_correction_bias",)
GROUP_NAMES = (("num_group", "topk_group"), ("n_group", "topk_group"))
SCALE_NAMES = ("routed_scaling_factor",)


def describe_router(module: nn.Module, path: str) -> list[RouterModule] | str:
    """The candidate rules of a router module, or why it is not one."""
    weight, k = _stacked_param(module, "weight", 2), _top_k(module)
    if isinstance(module, nn.Linear) or weight is None or k is None:
        return "no router: expected a module (not nn.Linear) with a weight [E, H] and a top-k attribute"
    if len(inspect.signature(module.forward).parameters) != 1:
        return "no router: expected forward(hidden_states)"
    correction = _child(module, CORRECTION_NAMES, torch.Tensor)
    groups = next(((vars(module)[g], vars(module)[t]) for g, t in GROUP_NAMES
                   if isinstance(vars(module).get(g), int) and isinstance(vars(module).get(t), int)), (1, 1))
    scales = {1.0} | {float(vars(module)[n]) for n in SCALE_NAMES if isinstance(vars(module).get(n), (int, float))}
    return [RouterModule(path, weight.shape[0], k, RouterRule(s, n, f, *g, scale), correction)
            for s, n, f, g, scale in itertools.product(ROUTER_SCORINGS, (False, True), (False, True),
                                                       dict.fromkeys((groups, (1, 1))), sorted(scales))]


def route(module: nn.Module, block: RouterModule, hidden: torch.Tensor):
    """(logits, weights, indices) by ``block.rule``, in ops with sharding rules (no in-place, no scatter)."""
    rule, weight = block.rule, module.weight
    flat = hidden.reshape(-1, weight.shape[1])
    bias = getattr(module, "bias", None)
    logits = F.linear(flat.float(), weight.float(), None if bias is None else bias.float()) if rule.float_logits \
        else F.linear(flat, weight, bias)
    if rule.scoring == "topk_softmax":
        top, indices = torch.topk(logits, block.top_k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=top.dtype)
    else:
        scores = F.softmax(logits, dim=-1, dtype=torch.float) if rule.scoring == "softmax" else logits.float().sigmoid()
        choice = scores + getattr(module, block.correction) if block.correction else scores
        indices = torch.topk(_group_limited(choice, rule), block.top_k, dim=-1)[1]
        weights = scores.gather(-1, indices)
    if rule.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)  # DeepSeek-V3's epsilon
    return logits, weights * rule.scale if rule.scale != 1.0 else weights, indices


def _group_limited(choice: torch.Tensor, rule: RouterRule) -> torch.Tensor:
    """Scores outside the ``topk_group`` best groups (a group scores its two best experts) set to
    -inf (DeepSeek-V3's node-limited routing), with a comparison where the model scatters."""
    if rule.groups == 1:
        return choice
    grouped = choice.view(*choice.shape[:-1], rule.groups, -1)
    best = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
    chosen = best.topk(rule.topk_group, dim=-1)[1]
    keep = (chosen.unsqueeze(-1) == torch.arange(rule.groups, device=choice.device)).sum(dim=-2) > 0
    return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).reshape(choice.shape)


def router_forward(module: nn.Module, block: RouterModule):
    def forward(hidden_states: torch.Tensor):
        return route(module, block, hidden_states)
    return forward


@torch.no_grad()
def verify_router(module: nn.Module, blocks: list[RouterModule]) -> RouterModule | None:
    """The rule that reproduces the router's own (logits, weights, indices); None when the module
    is no router of this kind (its forward returns something else)."""
    if module.weight.device.type == "meta":
        return None
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(9, module.weight.shape[1], generator=gen).to(module.weight.device, module.weight.dtype)
    try:
        expected = module(x)
    except Exception:  # noqa: BLE001 - not a router we can call alone
        return None
    if not (isinstance(expected, tuple) and len(expected) == 3 and not expected[2].is_floating_point()):
        return None
    scored = [(_router_error(route(module, b, x), expected), i, b) for i, b in enumerate(blocks)]
    best = min(scored, key=lambda item: item[:2])
    if best[0] <= _tolerance(module.weight.dtype):
        return RouterModule(**{**best[2].__dict__, "verified": True})
    raise MoEPatternError(blocks[0].path, "no routing usc knows (softmax, sigmoid or top-k-then-softmax, "
                                          "optionally group-limited, renormalised and scaled) reproduces its forward")


def _router_error(got, expected) -> float:
    """Logits compared as they are; the k (index, weight) pairs of each token compared as a set
    (the order of the k slots does not change the block's output)."""
    if got[2].shape != expected[2].shape or got[1].shape != expected[1].shape:
        return float("inf")
    order_got, order_exp = got[2].argsort(-1), expected[2].argsort(-1)
    if not torch.equal(got[2].gather(-1, order_got), expected[2].gather(-1, order_exp)):
        return float("inf")
    return max(_error(got[0], expected[0]),
               _error(got[1].gather(-1, order_got), expected[1].gather(-1, order_exp)))


def traced_blocks(model: nn.Module, marked: frozenset[str] = frozenset()) -> list[MoEBlock]:
    """``find_blocks`` for a trace: a block usc cannot reproduce is the TraceError it is for tracing,
    unless a rule marked it (the caller names the rule: ``MoEPatternError`` with its path)."""
    try:
        return find_blocks(model, marked)
    except MoEPatternError as err:
        if err.path in marked:
            raise
        raise TraceError(f"usc could not reproduce the mixture-of-experts block {err}") from None


def find_blocks(model: nn.Module, marked: frozenset[str] = frozenset()) -> list[MoEBlock]:
    """Every MoE block of ``model`` (outermost first), verified; ``marked`` paths must be blocks."""
    found: list[MoEBlock] = []
    for path, module in model.named_modules():
        if any(path.startswith(b.path + ".") for b in found):
            continue
        experts = describe_experts(module, path)
        if not isinstance(experts, str):
            found.append(verify_experts(module, experts))
            continue
        routers = describe_router(module, path)
        router = verify_router(module, routers) if not isinstance(routers, str) else None
        if router is not None:
            found.append(router)
            continue
        shape = describe_marked(module, path) if path in marked else describe(module, path)
        if isinstance(shape, str):
            if path in marked:
                raise MoEPatternError(path, shape)
            continue
        found.append(verify(module, shape))
    return found


# what each recognised kind traces in place of the module's own forward
FORWARDS = {MoEBlock: block_forward, ExpertsModule: experts_forward, RouterModule: router_forward}


@contextlib.contextmanager
def patched(model: nn.Module, blocks: list[MoEBlock]):
    """Each block's forward swapped for its usc::moe form while tracing."""
    modules = dict(model.named_modules())
    for block in blocks:
        modules[block.path].forward = FORWARDS[type(block)](modules[block.path], block)
    try:
        yield
    finally:
        for block in blocks:
            del modules[block.path].forward


__all__ = ["MoEBlock", "ExpertsModule", "RouterModule", "MoEPatternError", "Routing", "find_blocks", "traced_blocks", "patched", "moe", "swiglu", "expert_weights", "expert_tensors"]
