"""dtype=bf16: casts that mean "back to the model's dtype" cast to bfloat16.

The model is traced in float32, so ``h.float()`` and ``h.to(x.dtype)`` both appear as casts to
float32 (a norm that upcasts for its statistics and casts back, as Hugging Face's RMSNorm does).
Under dtype=bf16 the program runs in bfloat16, and the cast back must give bfloat16 again, or the
next matmul meets float32 activations and bfloat16 weights. The pass tells them apart by what
they cast: a cast to float32 of a value computed from an earlier cast to float32 is a cast back.
Each cast is in the graph as the model wrote it, with its own uses only (``compiler/casts.py``:
torch records a cast to a value's own dtype as the value itself). Values computed from an island
stay in it by torch's promotion (a float32 scalar does not lift a bf16 tensor); a matmul, norm,
attention or expert op where an island meets a bf16 value runs in bf16. A random draw made like a
tensor (dropout's mask, ``rand_like``) is drawn in that tensor's dtype, as torch draws it: a float32
mask would lift a bf16 activation to float32 (and fail at the next matmul with a bf16 weight).

Requires: the traced graph (before propagation). Establishes: such casts name the compute dtype;
every float32-traced value's ``meta["usc_runs_in"]`` names the dtype it runs in, and
``meta[ISLAND]`` whether a bf16 run keeps it in float32 (marked under every plan).
"""

from __future__ import annotations

import torch
import torch.fx as fx

import usc.compiler.moe  # noqa: F401 - registers usc::moe, whose tokens meet the experts' weights
from usc.compiler.report import ISLAND, RUNS_IN  # node.meta keys this pass sets (see the docstring)
from usc.compiler.source_info import module_path, user_source

from .random_ops import DRAW, DRAW_DTYPE

aten = torch.ops.aten
CASTS = {aten.to.dtype: 1, aten._to_copy.default: "dtype"}
COMPUTE = {"bf16": torch.bfloat16}
# ``x.to(device)``, ``x.cpu()``, ``x.to(memory_format=...)``: export records the traced dtype as the
# target, but the model asked for no dtype (an explicit one records ``to.dtype`` or ``to.device``).
MOVES = {aten.to.dtype_layout}


def compute_dtype_pass(gm: fx.GraphModule, ctx, *, params: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Under dtype=bf16, the casts and inputs rewritten as the module docstring says; under any plan,
    the float32 islands marked (``ISLAND``: what a bf16 run of the same program keeps in float32, which
    the cost profile's probes, compiled without a dtype, read to count those bytes at full size)."""
    dtype = COMPUTE.get(ctx.plan.get("dtype"))
    if dtype is not None:
        _refuse_casts_of_wide_models(gm, ctx, params)
    upcast: set[fx.Node] = set()  # values computed in float32 on purpose
    by_name = {n.name: n for n in gm.graph.nodes}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        inputs = [a for a in node.all_input_nodes]
        if node.target is DRAW and node.args[DRAW_DTYPE] == torch.float32:
            # drawn like a tensor (dropout's mask, rand_like): in that tensor's dtype, as torch draws
            like = by_name.get(node.meta.get("usc_draw_like"))
            if like is None or like in upcast:
                upcast.add(node)  # a float32 factory the model wrote, or an island's own draw
            elif dtype is not None:
                node.args = node.args[:DRAW_DTYPE] + (dtype,) + node.args[DRAW_DTYPE + 1:]
        elif node.target in MOVES and _keeps_dtype(node):
            if dtype is not None:
                node.kwargs = {**node.kwargs, "dtype": None}  # a device move keeps the dtype it meets
            if any(a in upcast for a in inputs):
                upcast.add(node)
        elif node.target in CASTS and _cast_dtype(node) == torch.float32:
            if not any(a in upcast for a in inputs):
                upcast.add(node)
            elif dtype is not None:
                _set_cast_dtype(node, dtype)  # the cast back
        elif node.target is aten.type_as.default:
            if node.args[1] in upcast:  # ``x.type_as(y)``: y's dtype, whatever x was
                upcast.add(node)
        elif node.target in STRICT and _mixed(node, upcast):
            if dtype is not None:  # runs in the compute dtype, as the model's weights
                _cast_upcast_inputs(gm, node, upcast, dtype)
        elif _promotes(node, upcast):
            upcast.add(node)
    _mark(gm, upcast, dtype or torch.float32)
    if dtype is not None:
        gm.recompile()
    return gm


# Ops whose floating inputs must share one dtype (a matmul or norm with its bf16 weight).
STRICT = {aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
          aten.baddbmm.default, aten.layer_norm.default, aten.native_layer_norm.default,
          aten.group_norm.default, aten.conv1d.default, aten.conv2d.default, aten.convolution.default,
          aten.scaled_dot_product_attention.default, torch.ops.usc.moe.default}


def _promotes(node: fx.Node, upcast: set[fx.Node]) -> bool:
    """The op computes in float32 because an input does, by torch's promotion: a float32 value with
    dimensions does; a float32 scalar (0-d, ``x * scale.to(torch.float32)``) does not lift a bf16
    tensor with dimensions."""
    if not any(a in upcast for a in node.all_input_nodes):
        return False
    floats = _floats(node)
    dims = [a for a in floats if a.meta["val"].dim() > 0]
    return not dims or any(a in upcast for a in dims)


def _keeps_dtype(node: fx.Node) -> bool:
    source, value = node.args[0] if node.args else None, node.meta.get("val")
    return (isinstance(source, fx.Node) and isinstance(value, torch.Tensor)
            and isinstance(source.meta.get("val"), torch.Tensor) and source.meta["val"].dtype == value.dtype)


def _floats(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dtype == torch.float32]


def _mixed(node: fx.Node, upcast: set[fx.Node]) -> bool:
    """A float32 value computed on purpose meets one in the compute dtype (a weight, the residual
    stream). A model's ``x.to(torch.float32)`` of a value traced in float32 is the value itself at
    trace time, so later uses of that value (a residual add after a norm that upcasts) are recorded
    through the cast and count as float32 on purpose; at such a meeting the model meant its own dtype."""
    floats = _floats(node)
    return any(a in upcast for a in floats) and any(a not in upcast for a in floats)


def _cast_upcast_inputs(gm: fx.GraphModule, node: fx.Node, upcast: set[fx.Node], dtype: torch.dtype) -> None:
    for value in [a for a in _floats(node) if a in upcast]:
        with gm.graph.inserting_before(node):
            cast = gm.graph.call_function(aten._to_copy.default, (value,), {"dtype": dtype})
        cast.meta.update({k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")})
        cast.meta["val"] = value.meta["val"]
        node.replace_input_with(value, cast)


def _mark(gm: fx.GraphModule, upcast: set[fx.Node], dtype: torch.dtype) -> None:
    """Each float32-traced value records the dtype it runs in (``RUNS_IN``): ``dtype``, but float32
    where the model computes in float32 on purpose; the compile report reads it for the bytes a
    collective moves (the executor casts state and inputs to the compute dtype)."""
    wide: set[fx.Node] = set()  # float64 values computed in float64 on purpose
    for node in gm.graph.nodes:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
            node.meta[RUNS_IN] = torch.float32 if node in upcast else dtype
            node.meta[ISLAND] = node in upcast
        elif isinstance(value, torch.Tensor) and value.dtype == torch.float64 and dtype != torch.float32:
            # a float64 model under a compute dtype: state and inputs enter cast, and what is computed
            # from them runs in it; an explicit cast to float64 or a float64 factory stays float64
            if node.op != "placeholder" and (_casts_to(node, torch.float64) or not _floats_of(node)
                                             or any(a in wide for a in node.all_input_nodes)):
                wide.add(node)
            else:
                node.meta[RUNS_IN] = dtype


def _refuse_casts_of_wide_models(gm: fx.GraphModule, ctx, params: frozenset[str]) -> None:
    """dtype=bf16 reads a model's casts as a float32 model's (``h.float()`` up, ``h.to(x.dtype)``
    back). A model whose weights (``params``: the trainable ones) are float64 means other things by
    them -- its ``.to(x.dtype)`` is a cast to float64 -- and would leave float64 values to meet bf16
    weights (a dtype error inside torch at the first step). Such a model is refused here; a float64
    model without casts runs in bf16, and a float32 model with a float64 buffer is a float32 model."""
    weights = [n for n in gm.graph.nodes if n.op == "placeholder" and n.name in params
               and isinstance(n.meta.get("val"), torch.Tensor) and n.meta["val"].is_floating_point()]
    if not weights or any(n.meta["val"].dtype != torch.float64 for n in weights):
        return
    cast = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target in CASTS
                 and _cast_dtype(n) in (torch.float32, torch.float64)), None)
    if cast is not None:
        where = f"module '{module_path(cast) or '<root>'}'" + (f" ({user_source(cast)})" if user_source(cast) else "")
        to = str(_cast_dtype(cast)).replace("torch.", "")
        raise ctx.plan.error_at("dtype", f"dtype=bf16 reads a model's casts as a float32 model's, and this model's "
                                         f"weights are float64 while it casts to {to} in {where}: some values would "
                                         f"stay wider than the bf16 weights they meet",
                                hint="cast the model to float32 (model.float()) for dtype=bf16, or train it in float64 "
                                     "without dtype=")


def _casts_to(node: fx.Node, dtype: torch.dtype) -> bool:
    return node.op == "call_function" and node.target in CASTS and _cast_dtype(node) == dtype


def _floats_of(node: fx.Node) -> list[fx.Node]:
    """The floating tensor inputs of ``node``, of any width."""
    return [a for a in node.all_input_nodes
            if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].is_floating_point()]


def _cast_dtype(node: fx.Node):
    where = CASTS[node.target]
    if isinstance(where, int):
        return node.args[where] if len(node.args) > where else node.kwargs.get("dtype")
    return node.kwargs.get(where)


def _set_cast_dtype(node: fx.Node, dtype: torch.dtype) -> None:
    where = CASTS[node.target]
    if isinstance(where, int) and len(node.args) > where:
        node.args = node.args[:where] + (dtype,) + node.args[where + 1:]
    else:
        node.kwargs = {**node.kwargs, "dtype": dtype}
