"""Triton lowering: write a readable Triton kernel (forward and backward) from a fused region's ops.

Each ATen op is first lowered to a few primitives (``LOWER``); the backward kernel recomputes the
primitives and walks them in reverse with one gradient rule per primitive (``PRIMS``): reverse-mode
differentiation written out as source lines, so the backward is generated, not recomputed in eager
mode. The lines (loads, primitives, gradients, stores) are then scheduled into loops over the tiles
of a row by ``passes/triton_tiles.py``: a row of any length runs in tiles of BLOCK columns, in
float32 registers (masked past the row's end), inputs such as norm weights or RoPE tables are
broadcast by stride 0, and each output is stored once. Programs take rows p, p + P, ...; a
gradient for an input broadcast over rows (a norm weight) is accumulated per program and summed
by the launcher, never written per row.

The source depends only on the region's ops, dtypes and broadcast pattern (shapes, strides and the
block are launch arguments), so equal regions (every layer's RMSNorm) share one kernel: its name
is the hash of its body.
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

from .triton_tiles import Effect, Line, row_body

if TYPE_CHECKING:  # fusion.py imports this module
    from .fusion import Region, ShapeFn

aten = torch.ops.aten


@dataclass(frozen=True)
class Prim:
    """A primitive: one element's expression and its gradient rule per argument (None: no gradient).
    A reduction's expression is the value summed (or maxed) over the row's columns."""

    expr: str
    grads: tuple[str | None, ...]  # in terms of g (output grad), o (output), a, b (arguments), c (count)
    reduce: str | None = None  # "sum" | "max": vec -> one value per row
    count: str | None = None  # a row sum the gradient rules read as {c}


# Forward expressions and gradient rules of the primitives (d/da, d/db). ``cols`` is the column
# index of each element of the tile.
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
    "rowsum": Prim("{a}", ("{g}",), reduce="sum"),
    # the gradient is shared by the columns holding the max (as torch's amax backward does)
    "rowmax": Prim("{a}", ("tl.where({a} == {o}, {g}, 0.0) / {c}",), reduce="max",
                   count="tl.where({a} == {o}, 1.0, 0.0)"),
    # the entry at column b (a label) of each row, and where a label is counted
    "pick": Prim("tl.where(cols == {b}, {a}, 0.0)", ("tl.where(cols == {b}, {g}, 0.0)", None), reduce="sum"),
    "counted": Prim("tl.where({a} != {b}, 1.0, 0.0)", (None, None)),
    # softmax's shift: any per-row constant gives the same result, so no gradient flows through it
    "rowmax_shift": Prim("{a}", (None,), reduce="max"),
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
        vec = PRIMS[prim].reduce is None and any(isinstance(a, Var) and a.vec for a in args)
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
    peak = b.emit("rowmax_shift", x)
    log_total = b.emit("log", b.emit("rowsum", b.emit("exp", b.emit("sub", x, peak))))
    # x[label] - max, not (x - max)[label]: the pick then reads x in the pass that finds the max
    per_row = b.emit("sub", log_total, b.emit("sub", b.emit("pick", x, labels), peak))
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


# ---------------------------------------------------------------- lines of the kernels
def _text(arg) -> str:
    return arg.name if isinstance(arg, Var) else arg.text


def _prim_lines(lines: list[_Line]) -> list[Line]:
    out = []
    for line in lines:
        prim = PRIMS[line.prim]
        expr = prim.expr.format(**dict(zip("ab", (_text(a) for a in line.args))))
        deps = tuple(a.name for a in line.args if isinstance(a, Var))
        out.append(Line(line.out.name, expr, deps, line.out.vec, prim.reduce, line.note, line.prim))
    return out


def _load_lines(loads: list[Load], lead_rank: int) -> list[Line]:
    """Each input's row offset (once per row), then its values: a tile of columns or one per row.
    Floats compute in float32 (bf16 math is wrong under the interpreter); labels stay integers."""
    out = []
    for i, load in enumerate(loads):
        offset = " + ".join([f"i{d} * in{i}_s{d}" for d in range(lead_rank)] or ["0"])
        convert = ".to(tl.float32)" if load.is_float else ""
        out.append(Line(f"o{i}", offset))
        if load.domain == "vec":
            out.append(Line(f"x{i}", f"tl.load(in{i} + o{i} + cols * in{i}_sn, mask=mask, other=0.0){convert}",
                            (f"o{i}",), True))
        else:
            out.append(Line(f"x{i}", f"tl.load(in{i} + o{i}){convert}", (f"o{i}",)))
    return out


def _as_tile(value: str, vec: bool) -> str:
    return value if vec else f"({value}) + tl.zeros([BLOCK], dtype=tl.float32)"


def _output_store(k: int, var: Var, vec: bool, lead_rank: int) -> Effect:
    """A whole-row output at its own strides, or one value per row (contiguous)."""
    if not vec:
        return Effect((f"tl.store(out{k} + row, {var.name}.to(out{k}.dtype.element_ty))",), (var.name,), False)
    where = " + ".join([f"out{k}"] + [f"i{d} * out{k}_s{d}" for d in range(lead_rank)] + [f"cols * out{k}_sn"])
    text = f"tl.store({where}, ({_as_tile(var.name, var.vec)}).to(out{k}.dtype.element_ty), mask=mask)"
    return Effect((text,), (var.name,), True)


def _grad_store(i: int, load: Load, grad: str | None, grad_vec: bool, lead_rank: int) -> Effect:
    """An input's gradient at the buffer's strides (0 along the dims the input is broadcast over):
    with ACC<i> the program adds to what it wrote for an earlier row (buffer row ``pid``)."""
    vec = load.domain == "vec"
    value = (_as_tile(grad, grad_vec) if grad else _as_tile("0.0", False)) if vec else \
        (grad or "tl.full([], 0.0, tl.float32)")
    where = " + ".join([f"gin{i}", f"pid * gin{i}_sp"] + [f"i{d} * gin{i}_s{d}" for d in range(lead_rank)]
                       + ([f"cols * gin{i}_sn"] if vec else []))
    masked = ", mask=mask" if vec else ""
    text = (f"d{i} = {value}", f"p{i} = {where}", f"if ACC{i}:",
            f"    d{i} = d{i} + tl.load(p{i}{masked}{', other=0.0' if vec else ''}).to(tl.float32)",
            f"tl.store(p{i}, d{i}.to(gin{i}.dtype.element_ty){masked})")
    return Effect(text, (grad,) if grad else (), vec)


@dataclass
class _Reverse:
    """Reverse mode over the primitive lines, as new lines: the gradient of v is a line named
    g_<v>[_k], each use adding to the last (single assignment: the tile scheduler moves lines)."""

    vec_of: dict[str, bool]
    lines: list[Line] = field(default_factory=list)
    grad: dict[str, str] = field(default_factory=dict)

    def line(self, base: str, expr: str, deps: tuple[str, ...], reduce: str | None = None, note: str = "") -> str:
        name, k = base, 0
        while name in self.vec_of:
            k += 1
            name = f"{base}_{k}"
        vec = reduce is None and (any(self.vec_of[d] for d in deps) or "cols" in expr)
        self.vec_of[name] = vec
        self.lines.append(Line(name, expr, deps, vec, reduce, note))
        return name

    def accumulate(self, target: Var, expr: str, deps: tuple[str, ...], note: str = "") -> None:
        if not target.vec and (any(self.vec_of[d] for d in deps) or "cols" in expr):
            # a row value read by every column: its gradient sums the columns' contributions
            term = self.line(f"g_{target.name}", expr, deps, "sum", note)
            expr, deps = term, (term,)
            if target.name not in self.grad:
                self.grad[target.name] = term
                return
        prev = self.grad.get(target.name)
        if prev is not None:
            expr, deps = f"{prev} + ({expr})", (prev, *deps)
        self.grad[target.name] = self.line(f"g_{target.name}", expr, deps, note=note)


def _reverse(lines: list[_Line], outputs: list[tuple[Var, bool]], vec_of: dict[str, bool]) -> _Reverse:
    """The gradient lines: output gradients loaded (contiguous), then each primitive in reverse."""
    rev = _Reverse(dict(vec_of))
    for k, (var, vec) in enumerate(outputs):
        load = f"tl.load(gout{k} + row * N + cols, mask=mask, other=0.0)" if vec else f"tl.load(gout{k} + row)"
        dy = rev.line(f"dy{k}", f"{load}.to(tl.float32)", ())  # a tile when it reads cols
        rev.accumulate(var, dy, (dy,))
    for line in reversed(lines):
        g = rev.grad.get(line.out.name)
        if g is None:
            continue
        prim = PRIMS[line.prim]
        names = {"g": g, "o": line.out.name, **{k: _text(a) for k, a in zip("ab", line.args)}}
        reads = {"g": g, "o": line.out.name, **{k: a.name for k, a in zip("ab", line.args) if isinstance(a, Var)}}
        if prim.count is not None:
            names["c"] = reads["c"] = rev.line(f"c_{line.out.name}", prim.count.format(**names),
                                               _reads(prim.count, reads), "sum", line.note)
        for arg, rule in zip(line.args, prim.grads):
            if rule is not None and isinstance(arg, Var):
                rev.accumulate(arg, rule.format(**names), _reads(rule, reads), line.note)
    return rev


def _reads(rule: str, reads: dict[str, str]) -> tuple[str, ...]:
    return tuple(name for key, name in reads.items() if "{" + key + "}" in rule)


# ---------------------------------------------------------------- source text
def _row_index(lead_rank: int) -> list[str]:
    """The row's coordinate along each leading dim (the last varies fastest)."""
    lines, rest = [], "row"
    for d in reversed(range(lead_rank)):
        if d:
            lines += [f"i{d} = {rest} % D{d}", f"r{d} = {rest} // D{d}"]
            rest = f"r{d}"
        else:
            lines.append(f"i0 = {rest}")
    return lines


def _kernel(name: str, groups: list[list[str]], flags: list[str], lead_rank: int, body: list[str]) -> list[str]:
    """One @triton.jit function: one header line per tensor (its pointer, then its strides), then
    the sizes; its programs take rows pid, pid + P, ... (P: the grid)."""
    rows = " * ".join(f"D{d}" for d in range(lead_rank)) or "1"
    return ["@triton.jit", f"def {name}(", *(f"    {', '.join(group)}," for group in groups),
            *(f"    {flag}: tl.constexpr," for flag in flags), "    ONE_TILE: tl.constexpr,",
            "    BLOCK: tl.constexpr,", "):",
            "    pid = tl.program_id(0).to(tl.int64)",
            f"    for row in range(pid, {rows}, tl.num_programs(0)):",
            *("        " + s for s in _row_index(lead_rank) + body)]


def _load_groups(loads: list[Load], lead_rank: int) -> list[list[str]]:
    lead = [f"_s{d}" for d in range(lead_rank)]
    return [[f"in{i}"] + [f"in{i}{s}" for s in lead] + ([f"in{i}_sn"] if load.domain == "vec" else [])
            for i, load in enumerate(loads)]


def _grad_groups(loads: list[Load], lead_rank: int) -> list[list[str]]:
    lead = [f"_s{d}" for d in range(lead_rank)]
    return [[f"gin{i}", f"gin{i}_sp"] + [f"gin{i}{s}" for s in lead] + ([f"gin{i}_sn"] if load.domain == "vec" else [])
            for i, load in enumerate(loads) if load.grad]


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
    lines = _load_lines(loads, lead_rank) + _prim_lines(builder.lines)
    stores = [_output_store(k, var, vec, lead_rank) for k, (var, vec) in enumerate(outputs)]
    rev = _reverse(builder.lines, outputs, {line.name: line.vec for line in lines})
    grad_stores = [_grad_store(i, load, rev.grad.get(f"x{i}"), rev.vec_of.get(rev.grad.get(f"x{i}"), False),
                               lead_rank) for i, load in enumerate(loads) if load.grad]
    sizes = [f"D{d}" for d in range(lead_rank)] + ["N"]
    out_groups = [[f"out{k}"] + ([f"out{k}_s{d}" for d in range(lead_rank)] + [f"out{k}_sn"] if vec else [])
                  for k, (_, vec) in enumerate(outputs)]
    forward = _kernel("KERNEL_fwd", _load_groups(loads, lead_rank) + out_groups + [sizes], [], lead_rank,
                      row_body(lines, stores))
    backward = _kernel("KERNEL_bwd", _load_groups(loads, lead_rank) + [[f"gout{k}"] for k in range(len(outputs))]
                       + _grad_groups(loads, lead_rank) + [sizes],
                       [f"ACC{i}" for i, load in enumerate(loads) if load.grad], lead_rank,
                       row_body(lines + rev.lines, grad_stores))
    body = "\n".join([*forward, "", "", *backward])
    wide = any(dtype_of(n) == torch.float64 for n in (*region.inputs, *region.nodes) if _is_float(n))
    if wide:  # float64 models compute in float64 (exact equivalence runs); all else in float32
        body = body.replace("tl.float32", "tl.float64")
    digest = hashlib.sha1(body.encode()).hexdigest()[:12]
    name = f"fused_{digest}"
    ops = ", ".join(str(n.target).replace("aten.", "").split(".")[0] for n in region.nodes)
    source = "\n".join(["# generated by usc (passes/triton_codegen.py): rows over programs, each row in tiles of "
                        "BLOCK columns", f"# ops: {ops}", "import triton", "import triton.language as tl", "", "",
                        body.replace("KERNEL", name), ""])
    stores_out = tuple(Store("vec" if vec else region.space.domain(tuple(shape_of(o)))) for (_, vec), o
                       in zip(outputs, region.outputs))
    return KernelSource(name, source, digest, tuple(loads), stores_out, lead_rank, "float64" if wide else "float32")


def _needs_grad(node: fx.Node) -> bool:
    ann = node.meta.get(META)
    return _is_float(node) and (ann is None or ann.needs_grad)
