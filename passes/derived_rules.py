"""Sharding rules for the ops usc has no hand rule for: the fallback chain after the hand rules.

Per aten op and mesh axis the chain is:

1. our hand rule (``sharding_rules.SHARDING_RULES``: partial-sum algebra, vocabulary parallel, losses);
2. PyTorch's registered DTensor sharding strategy for the op (``DTensor._op_dispatcher.
   sharding_propagator``: single-dim strategies and op strategies, hundreds of ops), asked on a
   one-axis mesh that has no process group;
3. for an op that acts along one dim only (``DIM_LOCAL_OPS``: index_add, ...) the shards of the
   other dims;
4. for a composite op (``CompositeImplicitAutograd``: rms_norm, einsum, conv1d/2d ...) its own
   decomposition, traced once per shape, with placements flowed through it by links 1-3;
5. replicate on that axis (the propagation pass redistributes first) for any other functional,
   deterministic op;
6. otherwise ``UnsupportedOpError`` (a ``CompileError``) naming op, module, source line and placements.

Every rule here has the hand rules' shape, ``OpView -> Decision`` (op + input placements on one
axis -> required input placements + output placement), so the rule verifier checks them the same
way. A derived decision is used only when it keeps usc's contract: the op runs unchanged on local
pieces, so the op is run once on meta tensors of the local shapes and must give the local shape
the decision claims (an op carrying global sizes in its arguments, like ``unflatten``, fails that
and replicates instead). Placements usc cannot hold (``Partial(avg)``, strided shards) fall back
to replicated too.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.utils._pytree import tree_leaves

from usc.compiler.errors import CompileError, ShardingError

from .graph_edit import flat_inputs, shape_of
from .sharding_rules import SHARDING_RULES, Decision, OpView, Rule

R = Replicate()
HAND, DTENSOR, DIM_LOCAL, DECOMPOSED, REPLICATED, NONE = (
    "hand rule", "DTensor strategy", "dim-local", "decomposition", "replicated", "none")
DRAWN = "counter-based draw"  # a random op, rewritten by random_ops before any rule places it
aten = torch.ops.aten

# Ops that act along one dim only (its argument position here): every other dim is independent, so a
# shard on another dim keeps (the batch under dp). DTensor has no strategy for these today.
DIM_LOCAL_OPS = {aten.index_add.default: 1, aten.index_copy.default: 1, aten.index_fill.int_Scalar: 1,
                 aten.index_fill.int_Tensor: 1, aten.scatter_reduce.two: 1, aten.index_reduce.default: 1}


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


# ---------------------------------------------------------------- which link an op takes

def _has_dtensor_strategy(op) -> bool:
    prop = _propagator()
    return op in prop.op_single_dim_strategy_funcs or op in prop.op_strategy_funcs or op in prop.op_to_rules


def _is_composite(op) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _is_pure(op) -> bool:
    """Functional and deterministic: every rank computing it on whole inputs gets one device's value.
    A random op would draw differently from one device; a mutating op writes through an alias."""
    schema = op._schema
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not mutates and torch.Tag.nondeterministic_seeded not in op.tags


# (test, link) in chain order; the first test an op passes names the link that decides it
_LINKS = ((_has_dtensor_strategy, DTENSOR), (DIM_LOCAL_OPS.__contains__, DIM_LOCAL), (_is_composite, DECOMPOSED),
          (lambda op: True, REPLICATED))


@lru_cache(maxsize=None)
def derived_link(op) -> str:
    """The link of the chain after the hand rules that decides ``op`` (``NONE``: it is refused).
    Random ops get none: DTensor would let each shard draw its own numbers, where usc promises one
    device's draw (random_ops rewrites them to draws first). In-place ops get none: the graph arrives
    functionalized, and one that does not is not safe to place by a rule that ignores aliasing."""
    if not isinstance(op, torch._ops.OpOverload) or not _is_pure(op):
        return NONE
    return next((link for test, link in _LINKS if test(op)), NONE)


def rule_link(op) -> str:
    """The link that decides ``op``, hand rules (and hand expansions, like the sharded cross-entropy)
    included: what the op-coverage figure counts. A random op random_ops rewrites into a counter-based
    draw before placement is placed as that draw (``DRAWN``)."""
    from .expansions import EXPANSIONS
    from .random_ops import RANDOM_ONLY_WITH_DROPOUT, RANDOM_RULES

    if op in RANDOM_RULES and op not in RANDOM_ONLY_WITH_DROPOUT:  # attention: placed by its rule without dropout
        return DRAWN
    return HAND if op in SHARDING_RULES or op in EXPANSIONS else derived_link(op)


@dataclass(frozen=True)
class DerivedRule:
    """A rule from link ``link`` of the chain; called like a hand rule."""

    op: object
    link: str

    def __call__(self, view: OpView) -> Decision:
        key = _signature(view)
        if key is None:
            return self.decide(view)
        if key not in _DECIDED:
            _DECIDED[key] = self.decide(view)
        return _DECIDED[key]

    def decide(self, view: OpView) -> Decision:
        try:
            decision = _DECIDERS[self.link](view)
            agreed = decision is not None and _holdable(decision, view) and _local_shapes_agree(view, decision)
        except CompileError:
            raise
        except Exception:  # noqa: BLE001 - a strategy or meta run that cannot decide (data-dependent sizes)
            agreed = False
        return decision if agreed else replicated(view)


# a model repeats its layers: one decision per op, shapes, arguments and placements
_DECIDED: dict[tuple, Decision] = {}


def _signature(view: OpView) -> tuple | None:
    inputs = iter(range(len(view.placements)))
    args = _with_specs((tuple(view.node.args), tuple(sorted(view.node.kwargs.items()))), _Marks(inputs))
    values = [x.meta.get("val") for x in flat_inputs(view.node)]
    tensors = tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None for v in values)
    key = (view.node.target, _hashable(args), tensors, view.placements, view.axis, view.size, view.out_shape,
           view.sequence_parallel)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class _Marks:
    """Stands in for tensor arguments in a signature: their shapes are keyed separately."""

    def __init__(self, it) -> None:
        self.it = it

    def __next__(self):
        return ("tensor", next(self.it))


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def derived_rule(op) -> DerivedRule | None:
    """The derived rule for an op with no hand rule, or None when no link accepts it."""
    link = derived_link(op)
    return None if link == NONE else DerivedRule(op, link)


def rule_for(target) -> Rule | None:
    """The fallback chain for one op: the hand rule (``SHARDING_RULES``), else the derived links
    (DTensor's strategy, the op's decomposition, replicated)."""
    return SHARDING_RULES.get(target) or derived_rule(target)


def replicated(view: OpView) -> Decision:
    return Decision((R,) * len(view.placements), R)


# ---------------------------------------------------------------- link 2: DTensor's strategies

@lru_cache(maxsize=None)
def _one_axis_mesh(size: int):
    """A DeviceMesh with no process group: the propagator only reads its shape."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(size), _init_backend=False, _rank=0)


def _spec(node: fx.Node, placement, mesh) -> DTensorSpec:
    value = node.meta["val"]
    return DTensorSpec(mesh, (placement,), TensorMeta(value.shape, value.stride(), value.dtype))


def _with_specs(value, specs):
    """node.args with each tensor node replaced by its spec (plain lists and tuples, as DTensor expects)."""
    if isinstance(value, fx.Node):
        return next(specs)
    if isinstance(value, (list, tuple)):
        return type(value)(_with_specs(v, specs) for v in value) if isinstance(value, tuple) \
            else [_with_specs(v, specs) for v in value]
    return value


def _dtensor_decision(view: OpView) -> Decision | None:
    mesh = _one_axis_mesh(view.size)
    node, op = view.node, view.node.target
    specs = iter([_spec(x, p, mesh) for x, p in zip(flat_inputs(node), view.placements)])
    args = _with_specs(tuple(node.args), specs)
    kwargs = {k: _with_specs(v, specs) for k, v in node.kwargs.items()}
    prop = _propagator()
    info = prop.op_to_schema_info_for_single_dim_strategy.get(op) or prop.op_to_schema_info.get(op)
    schema = OpSchema(op, args, kwargs, schema_info=info)  # info says e.g. that index's list holds tensors
    try:
        sharding = prop.propagate_op_sharding_non_cached(schema)
    except Exception:  # noqa: BLE001 - a strategy that cannot place these inputs: the chain goes on
        return None
    outputs = [s for s in tree_leaves(sharding.output_spec) if isinstance(s, DTensorSpec)]
    placed = {s.placements[0] for s in outputs}
    if len(placed) != 1:
        return None
    wanted = sharding.redistribute_schema or schema
    required = [s.placements[0] for s in tree_leaves((wanted.args_schema, wanted.kwargs_schema))
                if isinstance(s, DTensorSpec)]
    return Decision(tuple(required), placed.pop()) if len(required) == len(view.placements) else None


def _dim_local_decision(view: OpView) -> Decision | None:
    """The first shard on a dim other than the op's: tensors of the output's rank follow it, the rest
    (index vectors, scalars) stay whole."""
    out_rank = len(view.out_shape or ())
    dim = view.arg(DIM_LOCAL_OPS[view.node.target])
    dim = dim + out_rank if dim < 0 else dim
    shard = next((p for p in view.placements if isinstance(p, Shard) and p.dim != dim), None)
    if shard is None:
        return None
    inputs = tuple(shard if len(shape) == out_rank else R for shape in view.shapes)
    return Decision(inputs, shard)


# ---------------------------------------------------------------- link 3: the op's decomposition

def _meta_like(node: fx.Node, shape=None) -> torch.Tensor:
    value = node.meta["val"]
    return torch.empty(shape if shape is not None else value.shape, dtype=value.dtype, device="meta")


def _call_with(node: fx.Node, tensors: list[torch.Tensor]):
    it = iter(tensors)
    args = _with_specs(tuple(node.args), it)
    kwargs = {k: _with_specs(v, it) for k, v in node.kwargs.items()}
    return node.target(*args, **kwargs)


def _decomposition(view: OpView) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    node = view.node
    return make_fx(lambda *ts: _call_with(node, list(ts)), tracing_mode="fake")(
        *[_meta_like(x) for x in flat_inputs(node)])


def _candidates(placements: tuple) -> list[tuple]:
    """The inputs as placed, then with partial sums reduced, then all whole."""
    reduced = tuple(R if isinstance(p, Partial) else p for p in placements)
    return list(dict.fromkeys([placements, reduced, (R,) * len(placements)]))


def _decomposed_decision(view: OpView) -> Decision | None:
    try:
        gm = _decomposition(view)
    except Exception:  # noqa: BLE001 - a composite that does not trace on meta tensors is replicated
        return None
    for candidate in _candidates(view.placements):
        out = _flow(gm, candidate, view)
        if out is not None:
            return Decision(candidate, out)
    return None


def _flow(gm: fx.GraphModule, placements: tuple, outer: OpView):
    """The output placement when every op of the decomposition accepts its inputs as placed
    (no redistribution inside the op), else None."""
    placed: dict[fx.Node, object] = {}
    inputs = iter(placements)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            placed[node] = next(inputs)
        elif node.op == "call_function":
            ins = tuple(placed[x] for x in flat_inputs(node))
            view = OpView(node, ins, tuple(shape_of(x) or () for x in flat_inputs(node)), shape_of(node),
                          outer.axis, outer.size)
            decision = _inner_decision(rule_for(_out_of_place(node.target)), view)
            if decision is None or tuple(decision.inputs) != ins:
                return None
            placed[node] = decision.output
        elif node.op == "output":
            outs = {placed[x] for x in flat_inputs(node)}
            return outs.pop() if len(outs) == 1 else None
    return None


def _out_of_place(op):
    """A decomposition writes in place into its own temporaries (rms_norm's ``add_`` of eps): only the
    placements flow here (the composite op itself is what runs), so the out-of-place twin's rule applies."""
    name = getattr(op, "_schema", None) and op._schema.name.split("::")[-1]
    if not name or not name.endswith("_") or name.startswith("_"):
        return op
    return getattr(getattr(torch.ops.aten, name[:-1], None), op._overloadname, op)


def _inner_decision(rule, view: OpView) -> Decision | None:
    if rule is None:
        return replicated(view) if all(p == R for p in view.placements) else None
    try:
        return rule(view)
    except ShardingError:
        return None


# ---------------------------------------------------------------- checks on a derived decision

def _holdable(decision: Decision, view: OpView) -> bool:
    """Placements usc's layouts and collectives hold: whole, a plain shard, or a partial sum/max
    (a partial input only where it came in partial)."""
    def ok(p) -> bool:
        # exactly Partial: DTensor's _NormPartial says "sum" but reduces as a p-norm
        return type(p) in (Replicate, Shard) or (type(p) is Partial and p.reduce_op in ("sum", "max"))

    inputs_ok = all(ok(p) and (not isinstance(p, Partial) or p == have)
                    for p, have in zip(decision.inputs, view.placements))
    return inputs_ok and ok(decision.output)


def _local(shape, placement, size: int):
    if isinstance(placement, Shard):
        shape = list(shape)
        shape[placement.dim] //= size
    return shape


def _local_shapes_agree(view: OpView, decision: Decision) -> bool:
    """Run the op on meta tensors of the local shapes: it must give the local output shape the
    decision claims (an op with global sizes in its arguments does not)."""
    if all(p == R for p in decision.inputs) and decision.output == R:
        return True
    node = view.node
    tensors = [_meta_like(x, _local(shape_of(x) or (), p, view.size))
               for x, p in zip(flat_inputs(node), decision.inputs)]
    try:
        out = _call_with(node, tensors)
    except Exception:  # noqa: BLE001 - the op refuses local shapes: not runnable on pieces
        return False
    first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
    expected = _local(view.out_shape or (), decision.output, view.size)
    return first is not None and list(first.shape) == list(expected)


_DECIDERS = {DTENSOR: _dtensor_decision, DIM_LOCAL: _dim_local_decision, DECOMPOSED: _decomposed_decision,
             REPLICATED: lambda view: None}


def derived_source(op, view: OpView) -> Decision | None:
    """The chain after the hand rules as a rule source for ``usc.testing.verify_rules``:
    ``python -m usc.testing.verify_rules --source usc.passes.derived_rules:derived_source --ops ...``."""
    rule = derived_rule(op)
    return None if rule is None else rule(view)
