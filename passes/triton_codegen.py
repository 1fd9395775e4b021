"""Triton lowering: write a readable Triton kernel (forward and backward) from a fused region's ops.

The kernel runs one program per row of the region's row space (``passes/fusion.py``): it loads
each input once (broadcasting inputs such as norm weights or RoPE tables by stride 0), computes the
region's ops in float32 registers over a BLOCK of the last dim (masked where the row length is not
a power of two), and stores each output once. Each ATen op is first lowered to a few primitives
(``LOWER``); the backward kernel recomputes the primitives and walks them in reverse with one
gradient rule per primitive (``PRIMS``): reverse-mode differentiation written out as source, so the
backward is generated, not recomputed in eager mode. A gradient for an input loaded by broadcast
(a norm weight) is written per row and summed by the launcher (``sum_to_size``).

The source depends only on the region's ops, dtypes and broadcast pattern (shapes and strides are
runtime arguments), so equal regions (every layer's RMSNorm) share one kernel: its name is the hash
of its body.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.fx as fx

from usc.compiler.ir import META
from usc.runtime.fused import KernelSource, Load, Store

if TYPE_CHECKING:  # fusion.py imports this module
    from .fusion import Region, ShapeFn

aten = torch.ops.aten


@dataclass(frozen=True)
class Prim:
    """A primitive: its forward expression and its gradient rule per argument (None: no gradient)."""

    expr: str
    grads: tuple[str | None, ...]  # in terms of g (output grad), o (output), a, b (arguments)
    reduces: bool = False  # vec -> one value per row
    grad_vec: bool | None = None  # the gradient is a whole row even when it reads no whole row


# Forward expressions and gradient rules of the primitives (d/da, d/db).
PRIMS = {
    "add": Prim("{a} + {b}", ("{g}", "{g}")),
    "sub": Prim("{a} - {b}", ("{g}", "-{g}")),
    "mul": Prim("{a} * {b}", ("{g} * {b}", "{g} * {a}")),
    "div": Prim("{a} / {b}", ("{g} / {b}", "-{g} * {o} / {b}")),
    "neg": Prim("-{a}", ("-{g}",)),
    "exp": Prim("tl.exp({a})", ("{g} * {o}",)),
    "log": Prim("tl.log({a})", ("{g} / {a}",)),
    "rsqrt": Prim("tl.rsqrt({a})", ("-0.5 * {g} * {o} * {o} * {o}",)),
    "sqrt": Prim("tl.sqrt({a})", ("0.5 * {g} / {o}",)),
    "sigmoid": Prim("tl.sigmoid({a})", ("{g} * {o} * (1.0 - {o})",)),
    # tanh through the sigmoid: tl has no tanh that also runs under the interpreter
    "tanh": Prim("2.0 * tl.sigmoid(2.0 * {a}) - 1.0", ("{g} * (1.0 - {o} * {o})",)),
    "erf": Prim("tl.erf({a})", ("{g} * 1.1283791670955126 * tl.exp(-{a} * {a})",)),
    "relu": Prim("tl.maximum({a}, 0.0)", ("tl.where({a} > 0.0, {g}, 0.0)",)),
    "detach": Prim("{a}", (None,)),
    "rowsum": Prim("tl.sum(tl.where(mask, {a}, 0.0), axis=0)", ("{g}",), reduces=True),
    "rowmax": Prim("tl.max(tl.where(mask, {a}, -float('inf')), axis=0)",
                   ("tl.where(({a} == {o}) & mask, {g}, 0.0) / tl.sum(tl.where(({a} == {o}) & mask, 1.0, 0.0), axis=0)",),
                   reduces=True),
    # the entry at column b (a label) of each row, and where a label is counted
    "pick": Prim("tl.sum(tl.where(cols == {b}, {a}, 0.0), axis=0)", ("tl.where(cols == {b}, {g}, 0.0)", None),
                 reduces=True, grad_vec=True),
    "counted": Prim("tl.where({a} != {b}, 1.0, 0.0)", (None, None)),
    # softmax's shift: any per-row constant gives the same result, so no gradient flows through it
    "rowmax_shift": Prim("tl.max(tl.where(mask, {a}, -float('inf')), axis=0)", (None,), reduces=True),
}


@dataclass(frozen=True)
class Var:
    name: str
    vec: bool  # a whole row (BLOCK values) or one value per row


@dataclass(frozen=True)
class Const:
    text: str  # a Python literal, or N (the row length)


@dataclass
class _Line:
    out: Var
    prim: str
    args: tuple
    note: str


@dataclass
class _Builder:
    """Lowers region nodes to primitive lines; loads region inputs on first use."""

    region: Region
    shape_of: ShapeFn
    lines: list[_Line] = field(default_factory=list)
    loads: list[Load] = field(default_factory=list)
    load_vars: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    note: str = ""

    def emit(self, prim: str, *args) -> Var:
        vec = not PRIMS[prim].reduces and any(isinstance(a, Var) and a.vec for a in args)
        out = Var(f"v{len(self.lines)}", vec)
        self.lines.append(_Line(out, prim, args, self.note))
        return out

    def value(self, arg, consumer: fx.Node):
        if not isinstance(arg, fx.Node):
            return Const(repr(float(arg)))
        if arg in self.env:
            return self.env[arg]
        return self._load(arg, consumer)

    def _load(self, node: fx.Node, consumer: fx.Node) -> Var:
        domain = self._load_domain(node, consumer)
        key = (node, domain)
        if key not in self.load_vars:
            index = self.region.inputs.index(node)
            as_float = _is_float(node) or node.meta["val"].dtype == torch.bool  # masks compute as 0/1
            self.loads.append(Load(index, domain, _is_float(node), as_float))
            self.load_vars[key] = Var(f"x{len(self.loads) - 1}", domain == "vec")
        return self.load_vars[key]

    def _load_domain(self, node: fx.Node, consumer: fx.Node) -> str:
        """Broadcast to the consumer's output (torch's rule): a last dim equal to the row length is
        a whole row; otherwise one value per row."""
        space = self.region.space
        fixed = INPUT_DOMAINS.get(consumer.target)
        if fixed is not None:
            return fixed[list(consumer.args).index(node)]
        out = space.domain(tuple(self.shape_of(consumer)))
        shape = tuple(self.shape_of(node))
        if out == "vec":
            return "vec" if shape and shape[-1] == space.length else "row"
        return out


# Reductions read whole rows; cross-entropy reads the logits' rows and one label per row.
INPUT_DOMAINS = {aten.sum.dim_IntList: ("vec",), aten.mean.dim: ("vec",), aten.amax.default: ("vec",),
                 aten.cross_entropy_loss.default: ("vec", "flat")}


def _is_float(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.dtype.is_floating_point


# ---------------------------------------------------------------- ATen op -> primitives
def _binary(prim: str) -> Callable:
    return lambda b, n: b.emit(prim, b.value(n.args[0], n), b.value(n.args[1], n))


def _unary(prim: str) -> Callable:
    return lambda b, n: b.emit(prim, b.value(n.args[0], n))


def _pow(b: _Builder, n: fx.Node) -> Var:
    a, p = b.value(n.args[0], n), float(n.args[1])
    if p == 0.5:
        return b.emit("sqrt", a)
    if p < 0:
        return b.emit("div", Const("1.0"), _power(b, a, int(-p)))
    return _power(b, a, int(p))


def _power(b: _Builder, a: Var, p: int) -> Var:
    if p == 1:
        return b.emit("mul", a, Const("1.0"))
    if p % 2 == 0:
        half = _power(b, a, p // 2) if p > 2 else a
        return b.emit("mul", half, half)
    return b.emit("mul", _power(b, a, p - 1), a)


def _silu(b: _Builder, n: fx.Node) -> Var:
    a = b.value(n.args[0], n)
    return b.emit("mul", a, b.emit("sigmoid", a))


def _gelu(b: _Builder, n: fx.Node) -> Var:
    a = b.value(n.args[0], n)
    if n.kwargs.get("approximate", "none") == "tanh":  # 0.5 a (1 + tanh(sqrt(2/pi) (a + 0.044715 a^3)))
        cube = b.emit("mul", b.emit("mul", a, a), a)
        inner = b.emit("add", a, b.emit("mul", cube, Const("0.044715")))
        t = b.emit("tanh", b.emit("mul", inner, Const(repr(math.sqrt(2 / math.pi)))))
    else:  # 0.5 a (1 + erf(a / sqrt(2)))
        t = b.emit("erf", b.emit("mul", a, Const(repr(1 / math.sqrt(2)))))
    return b.emit("mul", b.emit("mul", a, b.emit("add", t, Const("1.0"))), Const("0.5"))


def _mean(b: _Builder, n: fx.Node) -> Var:
    return b.emit("div", b.emit("rowsum", b.value(n.args[0], n)), Const("N"))


def _layer_norm(b: _Builder, n: fx.Node) -> Var:
    x = b.value(n.args[0], n)
    mean = b.emit("div", b.emit("rowsum", x), Const("N"))
    centred = b.emit("sub", x, mean)
    var = b.emit("div", b.emit("rowsum", b.emit("mul", centred, centred)), Const("N"))
    eps = n.args[4] if len(n.args) > 4 else 1e-5
    y = b.emit("mul", centred, b.emit("rsqrt", b.emit("add", var, Const(repr(float(eps))))))
    weight, bias = (n.args[2] if len(n.args) > 2 else None), (n.args[3] if len(n.args) > 3 else None)
    if weight is not None:
        y = b.emit("mul", y, b.value(weight, n))
    if bias is not None:
        y = b.emit("add", y, b.value(bias, n))
    return y


def _softmax(b: _Builder, n: fx.Node, *, log: bool = False) -> Var:
    x = b.value(n.args[0], n)
    shifted = b.emit("sub", x, b.emit("rowmax_shift", x))  # exp never overflows
    exp = b.emit("exp", shifted)
    total = b.emit("rowsum", exp)
    return b.emit("sub", shifted, b.emit("log", total)) if log else b.emit("div", exp, total)


def _cross_entropy_rows(b: _Builder, n: fx.Node) -> Var:
    """Per-row loss (reduction='none'): logsumexp(x) - x[label], 0 where the label is ignored.
    The log-probabilities are never written (Liger kernels' fused cross-entropy, Hsu et al. 2024)."""
    x, labels = b.value(n.args[0], n), b.value(n.args[1], n)
    ignore = int(n.args[4]) if len(n.args) > 4 else -100
    shifted = b.emit("sub", x, b.emit("rowmax_shift", x))
    log_total = b.emit("log", b.emit("rowsum", b.emit("exp", shifted)))
    per_row = b.emit("sub", log_total, b.emit("pick", shifted, labels))
    return b.emit("mul", per_row, b.emit("counted", labels, Const(str(ignore))))


LOWER: dict = {
    aten.cross_entropy_loss.default: _cross_entropy_rows,
    aten.add.Tensor: _binary("add"), aten.sub.Tensor: _binary("sub"), aten.mul.Tensor: _binary("mul"),
    aten.div.Tensor: _binary("div"), aten.neg.default: _unary("neg"), aten.exp.default: _unary("exp"),
    aten.log.default: _unary("log"), aten.rsqrt.default: _unary("rsqrt"), aten.sqrt.default: _unary("sqrt"),
    aten.sigmoid.default: _unary("sigmoid"), aten.tanh.default: _unary("tanh"), aten.relu.default: _unary("relu"),
    aten.detach.default: _unary("detach"),
    aten.reciprocal.default: lambda b, n: b.emit("div", Const("1.0"), b.value(n.args[0], n)),
    aten.pow.Tensor_Scalar: _pow, aten.silu.default: _silu, aten.gelu.default: _gelu,
    aten.sum.dim_IntList: _unary("rowsum"), aten.mean.dim: _mean, aten.amax.default: _unary("rowmax"),
    aten.layer_norm.default: _layer_norm,
    aten._softmax.default: _softmax, aten.softmax.int: _softmax,
    aten._log_softmax.default: lambda b, n: _softmax(b, n, log=True),
    aten.log_softmax.int: lambda b, n: _softmax(b, n, log=True),
}


# ---------------------------------------------------------------- source text
def _text(arg) -> str:
    return arg.name if isinstance(arg, Var) else arg.text


def _forward_line(line: _Line) -> str:
    names = dict(zip("ab", (_text(a) for a in line.args)))
    return f"    {line.out.name} = {PRIMS[line.prim].expr.format(**names)}  # {line.note}"


def _prologue(lead_rank: int) -> list[str]:
    lines = ["    row = tl.program_id(0).to(tl.int64)"]
    rest = "row"
    for d in reversed(range(lead_rank)):
        lines.append(f"    i{d} = {rest} % D{d}" if d else f"    i{d} = {rest}")
        if d:
            lines.append(f"    r{d} = {rest} // D{d}")
            rest = f"r{d}"
    lines += ["    cols = tl.arange(0, BLOCK)", "    mask = cols < N"]
    return lines


def _load_args(loads: list[Load], lead_rank: int) -> list[str]:
    out = []
    for i, load in enumerate(loads):
        out += [f"in{i}"] + [f"in{i}_s{d}" for d in range(lead_rank)] + ([f"in{i}_sn"] if load.domain == "vec" else [])
    return out


def _load_lines(loads: list[Load], lead_rank: int) -> list[str]:
    lines = []
    for i, load in enumerate(loads):
        offset = " + ".join([f"i{d} * in{i}_s{d}" for d in range(lead_rank)] or ["0"])
        # floats compute in float32 (bf16 math is wrong under the interpreter); labels stay integers
        convert = ".to(tl.float32)" if load.is_float else ""
        if load.domain == "vec":
            lines.append(f"    x{i} = tl.load(in{i} + {offset} + cols * in{i}_sn, mask=mask, other=0.0){convert}")
        else:
            lines.append(f"    x{i} = tl.load(in{i} + {offset}){convert}")
    return lines


def _store(pointer: str, value: Var, vec: bool, lead_rank: int | None = None) -> str:
    """A whole row (at the output's own strides when lead_rank is given, else contiguous), or one
    value per row (contiguous)."""
    if not vec:
        return f"    tl.store({pointer} + row, {value.name}.to({pointer}.dtype.element_ty))"
    shaped = value.name if value.vec else f"{value.name} + tl.zeros([BLOCK], dtype=tl.float32)"
    if lead_rank is None:
        where = f"{pointer} + row * N + cols"
    else:
        where = " + ".join([f"{pointer}"] + [f"i{d} * {pointer}_s{d}" for d in range(lead_rank)]
                           + [f"cols * {pointer}_sn"])
    return f"    tl.store({where}, ({shaped}).to({pointer}.dtype.element_ty), mask=mask)"


def _header(name: str, args: list[str]) -> list[str]:
    """One line per tensor (its pointer, then its strides), then the row space's sizes."""
    groups: dict[str, list[str]] = {}
    for arg in args:
        groups.setdefault(arg.split("_")[0] if arg[0] in "iog" else "sizes", []).append(arg)
    lines = [f"    {', '.join(group)}," for group in groups.values()]
    return ["@triton.jit", f"def {name}(", *lines, "    BLOCK: tl.constexpr,", "):"]


def _backward_lines(lines: list[_Line], outputs: list[tuple[Var, bool]], loads: list[Load]) -> list[str]:
    """Reverse mode over the primitives: g_<v> holds d(loss)/d(v), summed over every use."""
    grads: dict[str, Var] = {}
    body = []

    def accumulate(target: Var, expr: str, vec: bool) -> None:
        if target.vec and not vec:
            expr = f"({expr}) + tl.zeros([BLOCK], dtype=tl.float32)"
        elif not target.vec and vec:
            expr = f"tl.sum(tl.where(mask, {expr}, 0.0), axis=0)"
        name = f"g_{target.name}"
        body.append(f"    {name} = {name} + {expr}" if target.name in grads else f"    {name} = {expr}")
        grads[target.name] = target

    for k, (var, vec) in enumerate(outputs):
        load = f"tl.load(gout{k} + row * N + cols, mask=mask, other=0.0)" if vec else f"tl.load(gout{k} + row)"
        accumulate(var, f"{load}.to(tl.float32)", vec)
    for line in reversed(lines):
        if line.out.name not in grads:
            continue
        names = {"g": f"g_{line.out.name}", "o": line.out.name}
        names.update(zip("ab", (_text(a) for a in line.args)))
        for arg, rule in zip(line.args, PRIMS[line.prim].grads):
            if rule is None or not isinstance(arg, Var):
                continue
            accumulate(arg, rule.format(**names), _rule_is_vec(rule, line))
    for i, load in enumerate(loads):
        if not load.grad:
            continue
        var = Var(f"x{i}", load.domain == "vec")
        value = Var(f"g_x{i}", var.vec) if var.name in grads else Var("0.0", False)
        body.append(_store(f"gin{i}", value, var.vec))
    return body


def _rule_is_vec(rule: str, line: _Line) -> bool:
    """A gradient expression is a whole row when any value it reads is one."""
    if PRIMS[line.prim].grad_vec is not None:
        return PRIMS[line.prim].grad_vec
    read = [line.out] if "{g}" in rule or "{o}" in rule else []
    read += [arg for key, arg in zip("ab", line.args) if "{" + key + "}" in rule]
    return any(isinstance(v, Var) and v.vec for v in read)


def generate(region: Region, shape_of: ShapeFn, *, dtype_of: Callable[[fx.Node], torch.dtype]) -> KernelSource:
    """The forward and backward kernels of one region, as source text (see the module docstring)."""
    builder = _Builder(region, shape_of)
    for node in region.nodes:
        builder.note = str(node.target).replace("aten.", "")
        builder.env[node] = LOWER[node.target](builder, node)
    lead_rank = len(region.space.lead)
    outputs = [(builder.env[o], region.space.domain(tuple(shape_of(o))) == "vec") for o in region.outputs]
    loads = [Load(load.input, load.domain, load.grad and _needs_grad(region.inputs[load.input]), load.is_float)
             for load in builder.loads]
    dims = [f"D{d}" for d in range(lead_rank)] + ["N"]
    forward = [*_prologue(lead_rank), *_load_lines(loads, lead_rank),
               *(_forward_line(line) for line in builder.lines),
               *(_store(f"out{k}", var, vec, lead_rank) for k, (var, vec) in enumerate(outputs))]
    grad_ins = [f"gin{i}" for i, load in enumerate(loads) if load.grad]
    backward = [*_prologue(lead_rank), *_load_lines(loads, lead_rank),
                *(_forward_line(line) for line in builder.lines),
                *_backward_lines(builder.lines, outputs, loads)]
    load_args = _load_args(loads, lead_rank)
    out_args = [a for k, (_, vec) in enumerate(outputs)
                for a in [f"out{k}"] + ([f"out{k}_s{d}" for d in range(lead_rank)] + [f"out{k}_sn"] if vec else [])]
    grad_out_args = [f"gout{k}" for k in range(len(outputs))]
    body = "\n".join([*_header("KERNEL_fwd", load_args + out_args + dims), *forward, "", "",
                      *_header("KERNEL_bwd", load_args + grad_out_args + grad_ins + dims), *backward])
    wide = any(dtype_of(n) == torch.float64 for n in (*region.inputs, *region.nodes) if _is_float(n))
    if wide:  # float64 models compute in float64 (exact equivalence runs); all else in float32
        body = body.replace("tl.float32", "tl.float64")
    digest = hashlib.sha1(body.encode()).hexdigest()[:12]
    name = f"fused_{digest}"
    ops = ", ".join(str(n.target).replace("aten.", "").split(".")[0] for n in region.nodes)
    source = "\n".join(["# generated by usc (passes/triton_codegen.py): one program per row",
                        f"# ops: {ops}", "import triton", "import triton.language as tl", "", "",
                        body.replace("KERNEL", name), ""])
    stores = tuple(Store("vec" if vec else region.space.domain(tuple(shape_of(o)))) for (_, vec), o
                   in zip(outputs, region.outputs))
    return KernelSource(name, source, digest, tuple(loads), stores, lead_rank, "float64" if wide else "float32")


def _needs_grad(node: fx.Node) -> bool:
    ann = node.meta.get(META)
    return _is_float(node) and (ann is None or ann.needs_grad)
