"""Verify sharding rules against PyTorch's own OpInfo samples, the way PyTorch tests DTensor's
strategies: for every op a rule source covers, every sample input of that op (dims, keepdim,
index arguments, from ``torch.testing._internal.common_methods_invocations.op_db``) and every
placement combination of its inputs, ask the rule what it does; run each distinct decision on
simulated ranks (``rule_check.run_decision``) and compare with the op on one device, forward and
backward, in float64.

A rule source is any function ``(op, OpView) -> Decision | None`` (None: no rule for that op), so
the hand table and any derived table are checked the same way::

    python -m usc.testing.verify_rules            # the full sweep, a table per op
    python -m usc.testing.verify_rules --quick    # the CI subset
    python -m usc.testing.verify_rules --ops sum,gather --sizes 2,3
    python -m usc.testing.verify_rules --source derived --quick   # the DTensor-derived fallback
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from usc.compiler.errors import CompileError
from usc.passes.graph_edit import flat_inputs
from usc.passes.sharding_rules import SHARDING_RULES, Decision, OpView
from usc.planning import collector_paused

from .rule_check import Call, Skip, run_decision
from .rule_samples import EXTRA

RuleSource = Callable[[object, OpView], "Decision | None"]
R = Replicate()

# aten op name -> OpInfo names whose samples exercise it (beyond the same-named OpInfo)
OPINFO_NAMES: dict[str, tuple[str, ...]] = {
    "_to_copy": ("to", "double", "float", "int", "bool", "long", "half"),
    "to": ("to", "double", "float", "int", "bool", "long"),
    "type_as": ("type_as",),
    "_unsafe_view": ("view", "reshape", "flatten"),
    "view": ("view", "view_as", "flatten", "unflatten"),
    "reshape": ("reshape", "reshape_as", "flatten"),
    "cross_entropy_loss": ("nn.functional.cross_entropy",),
    **{loss: (f"nn.functional.{loss}",) for loss in (
        "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss", "kl_div", "binary_cross_entropy",
        "binary_cross_entropy_with_logits")},
    "linear": ("nn.functional.linear",),
    "embedding": ("nn.functional.embedding",),
    "scaled_dot_product_attention": ("nn.functional.scaled_dot_product_attention",),
    "constant_pad_nd": ("nn.functional.pad",),
    "pad": ("nn.functional.pad",),
    "silu": ("nn.functional.silu",),
    "gelu": ("nn.functional.gelu",),
    "relu": ("nn.functional.relu",),
    "layer_norm": ("nn.functional.layer_norm",),
    "_softmax": ("softmax",),
    "_log_softmax": ("log_softmax",),
    "slice": ("__getitem__", "narrow"),
    "select": ("select", "__getitem__"),
    "rsub": ("rsub",),
    "clamp_min": ("clamp_min", "clamp"),
    "clamp_max": ("clamp_max", "clamp"),
    "masked_fill": ("masked_fill",),
    "where": ("where",),
    "split_with_sizes": ("split_with_sizes", "split"),
    "alias": ("view_as",),
    "lift_fresh_copy": (),
    "detach": ("detach",),
}
QUICK_SIZES, QUICK_SAMPLES = (2, 5), 1  # OpInfo's sizes are 5, 10 and 20: 2 alone leaves many dims whole
RANDOM_OUTPUT = {"empty_like"}  # values not reproducible: nothing to compare


def is_random(call: Call) -> bool:
    """A call whose values differ run to run: dropout in training, attention with dropout."""
    name, args = _packet_name(call.node.target), call.node.args
    if name == "dropout":
        return args[1] > 0 and args[2]
    if name == "scaled_dot_product_attention":
        return bool(args[4] if len(args) > 4 else call.node.kwargs.get("dropout_p", 0.0))
    return name in RANDOM_OUTPUT


@dataclass
class OpResult:
    op: str
    samples: int = 0
    decisions: int = 0  # distinct (inputs -> output) decisions run
    passed: int = 0
    refused: int = 0  # combinations the rule refused with a ShardingError
    skipped: int = 0  # decisions the sizes could not run (indivisible dims)
    failures: list[str] = field(default_factory=list)
    note: str = ""


def hand_rules(op, view: OpView) -> Decision | None:
    rule = SHARDING_RULES.get(op)
    return None if rule is None else rule(view)


def derived_rules(op, view: OpView) -> Decision | None:
    """The fallback chain after the hand rules (``passes/derived_rules``), as a rule source."""
    from usc.passes.derived_rules import derived_rule

    rule = derived_rule(op)
    return None if rule is None else rule(view)


def derived_ops(index: dict[str, list], limit: int | None = 1) -> dict:
    """The aten ops OpInfo samples reach that have no hand rule but a derived one, with the OpInfos
    whose samples reach them."""
    from torch.testing._internal.common_methods_invocations import op_db

    from usc.passes.derived_rules import derived_link, NONE

    found: dict = {}
    for info in op_db:
        dtype = _dtype_for(info)
        if dtype is None:
            continue
        generator = None
        try:
            generator = info.sample_inputs("cpu", dtype, requires_grad=False)
            samples = list(itertools.islice(generator, limit))
        except Exception:  # noqa: BLE001 - an OpInfo that cannot make samples here
            continue
        finally:  # closed now, not by the collector inside a later trace (see calls_of)
            getattr(generator, "close", lambda: None)()
        for sample in samples:
            for op in _ops_of(info, sample):
                if op not in SHARDING_RULES and derived_link(op) != NONE:
                    found.setdefault(op, []).append(info)
    _collect_left_generators()
    return {op: list({id(i): i for i in infos}.values()) for op, infos in found.items()}


def _ops_of(info, sample) -> set:
    leaves, spec = tree_flatten(((sample.input, *sample.args), sample.kwargs))
    positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    if not positions:
        return set()
    try:
        with collector_paused():
            gm = make_fx(_sample_fn(info, leaves, spec, positions), pre_dispatch=True)(*[leaves[i] for i in positions])
    except Exception:  # noqa: BLE001 - a sample the tracer cannot take
        return set()
    return {n.target for n in gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}


def _sample_fn(info, leaves, spec, positions):
    def fn(*tensors):
        filled = list(leaves)
        for i, t in zip(positions, tensors):
            filled[i] = t
        args, kwargs = tree_unflatten(filled, spec)
        return info.op(*args, **kwargs)
    return fn


def rule_ops(source_ops: Iterable) -> list[torch._ops.OpOverload]:
    """The aten ops of a table (usc's own modules and operator.getitem have their own tests)."""
    return sorted((op for op in source_ops if isinstance(op, torch._ops.OpOverload)), key=str)


def _opinfos_by_name() -> dict[str, list]:
    from torch.testing._internal.common_methods_invocations import op_db

    index: dict[str, list] = {}
    for info in op_db:
        for name in {info.name, getattr(info, "aten_name", None) or info.name}:
            index.setdefault(name, []).append(info)
    return index


def _packet_name(op) -> str:
    return op._schema.name.split("::")[-1]


def opinfos_for(op, index: dict[str, list]) -> list:
    name = _packet_name(op)
    dotted = [key for key in index if key.replace(".", "_") == name]  # linalg_vector_norm: linalg.vector_norm
    names = OPINFO_NAMES.get(name, (name, name.lstrip("_"), *dotted))
    seen, out = set(), []
    for n in names:
        for info in index.get(n, []):
            if id(info) not in seen:
                seen.add(id(info))
                out.append(info)
    return out


def _dtype_for(info) -> torch.dtype | None:
    supported = info.supported_dtypes("cpu")
    for dtype in (torch.float64, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return None


def calls_of(op, info, limit: int | None) -> Iterable[Call]:
    """Concrete calls of ``op`` made by the OpInfo's samples (traced to aten, as torch.export's
    training IR keeps them)."""
    dtype = _dtype_for(info)
    if dtype is None:
        return
    found = 0
    samples = info.sample_inputs("cpu", dtype, requires_grad=False)
    try:
        for sample in samples:
            leaves, spec = tree_flatten(((sample.input, *sample.args), sample.kwargs))
            positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
            if not positions:
                continue
            fn = _sample_fn(info, leaves, spec, positions)
            for call in traced_calls(op, fn, [leaves[i] for i in positions]):
                yield call
                found += 1
                if limit is not None and found >= limit:
                    return
    finally:
        # closed here, not whenever the collector finds it: torch's sample generators leave a
        # no_grad context on close, which inside a later make_fx trace would be traced (and fail)
        close = getattr(samples, "close", None)
        if close is not None:
            close()


def traced_calls(op, fn, tensors) -> list[Call]:
    """The calls of ``op`` in ``fn(*tensors)`` traced to aten (as torch.export's training IR keeps
    them), with the concrete values of their inputs and outputs."""
    # no cycle collection while tracing: a sample generator torch left unclosed (one chained inside
    # another) leaves its no_grad context when collected, which inside the trace would be traced
    try:
        with collector_paused():
            gm = make_fx(fn, pre_dispatch=True)(*tensors)
        env = _run(gm, tensors)
    except Exception:  # noqa: BLE001 - a sample the tracer cannot take is not a rule's problem
        return []
    out = []
    for node in gm.graph.nodes:
        if node.target is op:
            inputs = [env[n] for n in flat_inputs(node)]
            if inputs and all(isinstance(x, torch.Tensor) for x in inputs):
                out.append(Call(node, tuple(inputs), env[node]))
    return out


def extra_calls(op) -> list[Call]:
    return [call for fn, tensors in EXTRA.get(op, []) for call in traced_calls(op, fn, list(tensors))]


def _run(gm: fx.GraphModule, tensors) -> dict:
    interp = fx.Interpreter(gm, garbage_collect_values=False)
    interp.run(*tensors)
    return interp.env


def candidates(x: torch.Tensor) -> list:
    """Every placement an input may arrive in on one mesh axis."""
    out = [R] + [Shard(d) for d in range(x.dim())]
    if x.is_floating_point():
        out.append(Partial("sum"))
    return out


def _view(call: Call, placements, size: int, axis: str, order: str) -> OpView:
    flat, _ = tree_flatten(call.output)
    first = next((o for o in flat if isinstance(o, torch.Tensor)), None)
    return OpView(call.node, tuple(placements), tuple(tuple(x.shape) for x in call.inputs),
                  tuple(first.shape) if first is not None else None, axis, size, order=order,
                  out_dtype=first.dtype if first is not None else None)


def decisions(source: RuleSource, call: Call, size: int, axis: str, order: str, result: OpResult) -> set:
    """The distinct decisions the rule makes over all input placement combinations."""
    out = set()
    combos = list(itertools.product(*(candidates(x) for x in call.inputs)))
    for placements in combos[:256]:
        try:
            decision = source(call.node.target, _view(call, placements, size, axis, order))
        except CompileError:
            result.refused += 1
            continue
        except Exception as exc:  # noqa: BLE001 - a rule that crashes is a finding
            result.failures.append(f"{_fmt(placements)}: the rule raised {type(exc).__name__}: {exc}")
            continue
        if decision is None:
            return set()
        if len(decision.inputs) != len(call.inputs):
            result.failures.append(f"{placements}: decision names {len(decision.inputs)} inputs, "
                                   f"the op has {len(call.inputs)}")
            continue
        out.add((tuple(decision.inputs), decision.output))
    return out


def verify_op(op, source: RuleSource, index: dict[str, list], *, sizes=(2,), orders=("contiguous",),
              axis: str = "dp", samples_per_info: int | None = None, infos=None) -> OpResult:
    result = OpResult(str(op))
    infos = opinfos_for(op, index) if infos is None else infos
    if not infos:
        result.note = "no OpInfo: usc samples only"
    sources = [(info.name, calls_of(op, info, samples_per_info)) for info in infos]
    sources.append(("usc", extra_calls(op)))
    for label, calls in sources:
        for call in calls:
            result.samples += 1
            if is_random(call):
                result.note = "random (dropout) samples not compared"
                continue
            for size, order in itertools.product(sizes, orders):
                for inputs, output in decisions(source, call, size, axis, order, result):
                    if all(isinstance(p, Replicate) for p in inputs) and isinstance(output, Replicate):
                        continue  # everything whole: every rank runs the one-device op
                    try:
                        problem = run_decision(call, inputs, output, size=size, order=order, axis=axis,
                                               backward=True)
                    except Skip:
                        result.skipped += 1
                        continue
                    except Exception as exc:  # noqa: BLE001 - the checker's own trouble, reported per op
                        problem = f"check raised {type(exc).__name__}: {exc}"[:200]
                    result.decisions += 1
                    if problem is None:
                        result.passed += 1
                    else:
                        shapes = [tuple(x.shape) for x in call.inputs]
                        result.failures.append(f"{label} {shapes} {_args_text(call.node)} size={size} "
                                               f"{order}: {_fmt(inputs)} -> {output}: {problem}")
    return result


def _args_text(node: fx.Node) -> str:
    consts = [a for a in node.args if not isinstance(a, (fx.Node, list, tuple)) or
              (isinstance(a, (list, tuple)) and not any(isinstance(b, fx.Node) for b in a))]
    kwargs = {k: v for k, v in node.kwargs.items() if not isinstance(v, fx.Node)}
    return (f"args={consts}" if consts else "") + (f" kwargs={kwargs}" if kwargs else "")


def _fmt(placements) -> str:
    return "(" + ", ".join(str(p) for p in placements) + ")"


def verify(source: RuleSource = hand_rules, ops=None, **kwargs) -> list[OpResult]:
    """Verify ``source`` on ``ops`` (default: the hand table's; for the derived rules, the ops
    OpInfo samples reach that the hand table lacks)."""
    index = _opinfos_by_name()
    try:
        if source is derived_rules and ops is None:
            reached = derived_ops(index)
            return [verify_op(op, source, index, infos=reached[op], **kwargs) for op in sorted(reached, key=str)]
        ops = rule_ops(SHARDING_RULES) if ops is None else ops
        return [verify_op(op, source, index, **kwargs) for op in ops]
    finally:
        _collect_left_generators()


def _collect_left_generators() -> None:
    """Collect now, outside any trace, the sample generators torch leaves in reference cycles (one
    chained inside another). Each leaves a no_grad context when finalised; left to the collector,
    that runs whenever it next runs -- inside a later make_fx or torch.export trace, where the
    context switch is traced and fails (an unraisable exception in whatever test traced next)."""
    gc.collect()


def table(results: list[OpResult]) -> str:
    lines = ["| op | samples | decisions run | passed | not runnable | refused combos | failures |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        note = f" ({r.note})" if r.note else ""
        lines.append(f"| `{r.op}`{note} | {r.samples} | {r.decisions} | {r.passed} | {r.skipped} | {r.refused} | {len(r.failures)} |")
    total = Counter()
    for r in results:
        total.update(samples=r.samples, decisions=r.decisions, passed=r.passed, failures=len(r.failures))
    lines.append(f"| **{len(results)} ops** | {total['samples']} | {total['decisions']} | {total['passed']} | | | "
                 f"{total['failures']} |")
    return "\n".join(lines)


def _select(names: str | None, source) -> list | None:
    """The ops named (aten packet names or full overload names) among the source's."""
    if not names:
        return None
    wanted = set(names.split(","))
    if source is derived_rules:
        ops = [getattr(getattr(torch.ops.aten, n.split(".")[0]), o) for n in wanted
               for o in (getattr(torch.ops.aten, n.split(".")[0]).overloads())]
        return [op for op in ops if _packet_name(op) in wanted or str(op) in wanted]
    return [op for op in rule_ops(SHARDING_RULES) if _packet_name(op) in wanted or str(op) in wanted]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", help="comma-separated aten op names (default: every op of the table)")
    parser.add_argument("--sizes", default="2,3,5", help="mesh axis sizes to simulate")
    parser.add_argument("--zigzag", action="store_true", help="also check the zig-zag chunk order")
    parser.add_argument("--quick", action="store_true", help="one sample per OpInfo, sizes 2 and 5 (the CI subset)")
    parser.add_argument("--source", default="hand", help="'hand', 'derived' or 'module:function' of another rule source")
    parser.add_argument("--failures", type=int, default=5, help="failures printed per op")
    args = parser.parse_args(argv)
    source = _load_source(args.source)
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(","))
    orders = ("contiguous", "zigzag") if args.zigzag else ("contiguous",)
    start = time.time()
    results = verify(source, _select(args.ops, source), sizes=sizes, orders=orders,
                     samples_per_info=QUICK_SAMPLES if args.quick else None)
    print(table(results))
    for r in results:
        for failure in r.failures[: args.failures]:
            print(f"FAIL {r.op}: {failure}")
    print(f"{time.time() - start:.1f} s")
    return 1 if any(r.failures for r in results) else 0


def _load_source(spec: str) -> RuleSource:
    if spec in SOURCES:
        return SOURCES[spec]
    module, _, name = spec.partition(":")
    return getattr(__import__(module, fromlist=[name]), name)


SOURCES = {"hand": hand_rules, "derived": derived_rules}

if __name__ == "__main__":
    sys.exit(main())
