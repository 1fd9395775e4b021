"""The classes of ATen ops every stage reads: one table per fact, so the recompute pass, its runtime
policy, the cost model's profile, the pipeline split's FLOP count and the lint facts agree on what a
matmul (or a view) is. It lives in runtime, the lowest stage that inspects ops: compiler and passes
import runtime, never the other way (DESIGN: imports run one way).
"""

from __future__ import annotations

import operator

import torch

aten = torch.ops.aten

# Matrix products at the graph level -> (index of the left operand, index of the right operand,
# the right operand's contracted dim). torch.export writes nn.Linear as linear; matmul/einsum
# decompose into the kernels below at dispatch.
MATMUL_OPERANDS = {
    aten.linear.default: (0, 1, -1),  # weight [out, in]: contracts its last dim
    aten.mm.default: (0, 1, -2),
    aten.bmm.default: (0, 1, -2),
    aten.matmul.default: (0, 1, -2),
    aten.addmm.default: (1, 2, -2),  # addmm(bias, x, w)
    aten.baddbmm.default: (1, 2, -2),
}
MATMULS = frozenset(MATMUL_OPERANDS) | {aten.einsum.default}
# Grouped products of mixture-of-experts layers: rows [S, K], each through its group's weight of
# [E, K, N], give [S, N] (torch's own, and transformers' fallback, which exists only once
# transformers is imported: both matched by name).
GROUPED_MATMUL_NAMES = frozenset({"aten::_grouped_mm", "transformers::grouped_mm_fallback"})


def is_grouped_matmul(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.name() in GROUPED_MATMUL_NAMES


def is_routed_experts(target) -> bool:
    """usc's own routed-experts op (``usc::moe``: a recognised mixture-of-experts block traced whole)."""
    return isinstance(target, torch._ops.OpOverload) and target.name() == "usc::moe"


# The kernels the products run as at dispatch (what a selective-checkpoint policy sees).
MATMUL_KERNELS = frozenset({aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default})
# Products with a weight matrix (the projections of a layer; bmm multiplies two activations).
LINEARS = frozenset({aten.linear.default, aten.addmm.default, aten.mm.default})
ATTENTION = frozenset({aten.scaled_dot_product_attention.default})

# Ops whose output reads its input's storage: tuple-valued ones (and getitem) ...
MULTI_OUTPUT_VIEWS = frozenset({aten.chunk.default, aten.unbind.int, aten.split.Tensor, operator.getitem})
# ... and single-output ones.
VIEWS = frozenset({aten.reshape.default, aten.view.default, aten.permute.default, aten.transpose.int,
                   aten.t.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
                   aten.slice.Tensor, aten.select.int, aten.expand.default, aten.alias.default,
                   aten.detach.default}) | MULTI_OUTPUT_VIEWS
# Views that only change the shape (what a loss's logits and labels pass through).
RESHAPES = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
# Ops whose output holds the input's values unchanged: a copy, a cast, an alias.
COPIES = frozenset({aten.clone.default, aten.contiguous.default, aten._to_copy.default, aten.to.dtype,
                    aten.to.dtype_layout, aten.to.device, aten.alias.default})
