"""Tiled kernel bodies: a fused region's kernel lines scheduled into loops over the tiles of a row.

A row is read in tiles of BLOCK columns, so a row of any length (a 128k-vocabulary cross-entropy
row) runs with bounded registers. A row that fits one tile (``ONE_TILE``) runs every line once, in
registers, in one pass. A value per column (a *vec* line) is computed tile by tile and
never stored; a value per row (a *scalar*) exists once the loop that reduces it has seen every
tile. The body of one row is therefore a sequence of loops over its tiles: loop k computes the
reductions whose inputs need only scalars finished by loops before k, recomputing the column values
they read from the loads (registers, not memory); a whole-row store runs in the first loop where its
value can be computed; scalar lines run between loops.

A max-shifted exponential sum, ``rowsum(exp(x - rowmax(x)))`` (softmax, log-softmax,
cross-entropy), is computed in the same loop as its max by online rescaling (Milakov and
Gimelshein 2018, "Online normalizer calculation for softmax"; the running max of flash
attention): each tile rescales the running sum by exp(old max - new max). A cross-entropy row is
read once forward, twice backward.

Rows: program p of P runs rows p, p + P, ... (P is the launch grid), so a gradient of an input that
is broadcast over rows (a norm weight) is accumulated per program (``ACC<i>``: add to what the
program wrote for an earlier row) into a [P, ...] buffer the launcher sums, never [rows, length].
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """``name = expr``: one value per column of the tile (vec) or one per row. A reduction line is
    the row's sum or max of ``expr`` (masked to the row's columns)."""

    name: str
    expr: str
    deps: tuple[str, ...] = ()  # the lines expr reads
    vec: bool = False
    reduce: str | None = None  # "sum" | "max"
    note: str = ""
    op: str = ""  # the primitive computed (read by the online-softmax match)


@dataclass(frozen=True)
class Effect:
    """Statements run for their effect (a store) once their deps exist: in a tile loop when vec."""

    text: tuple[str, ...]
    deps: tuple[str, ...]
    vec: bool


NEG_INF = "float('-inf')"
INIT = {"sum": "tl.full([], 0.0, tl.float32)", "max": f"tl.full([], {NEG_INF}, tl.float32)"}
COMBINE = {"sum": "{r} = {r} + tl.sum(tl.where(mask, {e}, 0.0), axis=0)",
           "max": "{r} = tl.maximum({r}, tl.max(tl.where(mask, {e}, " + NEG_INF + "), axis=0))"}


def online_pairs(lines: list[Line]) -> dict[str, tuple[str, str]]:
    """{sum line: (its max line, x)} for every ``rowsum(exp(x - rowmax(x)))``."""
    by = {line.name: line for line in lines}
    pairs = {}
    for line in lines:
        if line.op != "rowsum":
            continue
        exp = by.get(line.deps[0]) if line.deps else None
        shifted = by.get(exp.deps[0]) if exp is not None and exp.op == "exp" else None
        if shifted is None or shifted.op != "sub" or len(shifted.deps) != 2:
            continue
        x, peak = shifted.deps
        top = by.get(peak)
        if top is not None and top.op in ("rowmax", "rowmax_shift") and top.deps == (x,):
            pairs[line.name] = (peak, x)
    return pairs


def live_lines(lines: list[Line], effects: list[Effect]) -> list[Line]:
    """The lines the effects read, directly or through other lines (a dead reduction costs a pass)."""
    by = {line.name: line for line in lines}
    live, stack = set(), [d for e in effects for d in e.deps]
    while stack:
        name = stack.pop()
        if name in by and name not in live:
            live.add(name)
            stack.extend(by[name].deps)
    return [line for line in lines if line.name in live]


@dataclass
class _Plan:
    """When each line can run: ``ready`` is, for a scalar, the number of loops that must finish
    before it exists; for a vec line, the first loop it can be computed in."""

    lines: list[Line]
    effects: list[Effect]
    pairs: dict[str, tuple[str, str]]
    ready: dict[str, int]
    loop_of: dict[str, int]  # reduction -> the loop that computes it

    @property
    def loops(self) -> int:
        reductions = [k + 1 for k in self.loop_of.values()]
        stores = [self.effect_loop(e) + 1 for e in self.effects if e.vec]
        return max(reductions + stores, default=0)

    def effect_loop(self, effect: Effect) -> int:
        return max((self.ready[d] for d in effect.deps), default=0)


def plan(lines: list[Line], effects: list[Effect]) -> _Plan:
    lines = live_lines(lines, effects)
    pairs = online_pairs(lines)
    ready: dict[str, int] = {}
    loop_of: dict[str, int] = {}
    for line in lines:
        after = max((ready[d] for d in line.deps if d in ready), default=0)
        if line.reduce:
            loop_of[line.name] = loop_of[pairs[line.name][0]] if line.name in pairs else after
            ready[line.name] = loop_of[line.name] + 1
        else:
            ready[line.name] = after
    return _Plan(lines, effects, pairs, ready, loop_of)


def row_body(lines: list[Line], effects: list[Effect]) -> list[str]:
    """The statements of one row: in one pass when a tile holds the whole row (``ONE_TILE``, a
    constexpr: the compiler keeps one branch), else in loops over its tiles."""
    one, tiled = one_tile_body(lines, effects), tiled_body(lines, effects)
    # a backward with no gradient to write (no input needs one) has nothing to run: a block needs a body
    return ["if ONE_TILE:", *_indent(one or ["pass"]), "else:", *_indent(tiled or ["pass"])]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + s for s in lines]


REDUCE = {"sum": "tl.sum(tl.where(mask, {e}, 0.0), axis=0)",
          "max": "tl.max(tl.where(mask, {e}, " + NEG_INF + "), axis=0)"}


def one_tile_body(lines: list[Line], effects: list[Effect]) -> list[str]:
    """Every line once, in order, on the one tile that holds the row (loaded once, in registers)."""
    out = ["cols = tl.arange(0, BLOCK)", "mask = cols < N"]
    for line in live_lines(lines, effects):
        expr = REDUCE[line.reduce].format(e=line.expr) if line.reduce else line.expr
        out.append(_assign(Line(line.name, expr, note=line.note)))
    return out + [s for e in effects for s in e.text]


def tiled_body(lines: list[Line], effects: list[Effect]) -> list[str]:
    """The statements of one row in loops over its tiles (see the module docstring)."""
    p = plan(lines, effects)
    out: list[str] = []
    done: set[str] = set()
    _scalars(p, 0, out, done)
    for k in range(p.loops):
        out += _tile_loop(p, k)
        _scalars(p, k + 1, out, done)
    for effect in p.effects:
        if not effect.vec:
            out += list(effect.text)
    return out


def _scalars(p: _Plan, upto: int, out: list[str], done: set[str]) -> None:
    """Scalar lines that exist once ``upto`` loops have finished, in order."""
    for line in p.lines:
        if not line.vec and not line.reduce and line.name not in done and p.ready[line.name] <= upto:
            out.append(_assign(line))
            done.add(line.name)


def _tile_loop(p: _Plan, k: int) -> list[str]:
    reductions = [line for line in p.lines if line.reduce and p.loop_of[line.name] == k]
    stores = [e for e in p.effects if e.vec and p.effect_loop(e) == k]
    roots = [d for line in reductions for d in ((p.pairs[line.name][1],) if line.name in p.pairs else line.deps)]
    roots += [d for e in stores for d in e.deps]
    needed = _vec_cone(p, roots)
    head = [f"{line.name} = {INIT[line.reduce]}  # {line.note}" for line in reductions if line.name not in p.pairs]
    head += [f"{line.name} = {INIT['sum']}  # {line.note} (online)" for line in reductions if line.name in p.pairs]
    body = ["cols = start + tl.arange(0, BLOCK)", "mask = cols < N"]
    body += [_assign(line) for line in p.lines if line.name in needed]
    online = {peak: (total, x) for total, (peak, x) in p.pairs.items() if p.loop_of[total] == k}
    for line in reductions:
        if line.name in online:
            body += _online_update(line.name, *online[line.name])
        elif line.name not in p.pairs:
            body.append(COMBINE[line.reduce].format(r=line.name, e=line.expr))
    for effect in stores:
        body += list(effect.text)
    return head + ["for start in range(0, N, BLOCK):"] + _indent(body)


def _online_update(peak: str, total: str, x: str) -> list[str]:
    """Fold one tile into (running max, running sum of exp(x - max)); a row (or its first tiles)
    of -inf keeps the shift at 0 so no inf - inf appears."""
    return [f"{peak}_new = tl.maximum({peak}, tl.max(tl.where(mask, {x}, {NEG_INF}), axis=0))",
            f"{peak}_safe = tl.where({peak}_new == {NEG_INF}, 0.0, {peak}_new)",
            f"{total} = {total} * tl.exp({peak} - {peak}_safe) + "
            f"tl.sum(tl.where(mask, tl.exp({x} - {peak}_safe), 0.0), axis=0)",
            f"{peak} = {peak}_new"]


def _vec_cone(p: _Plan, roots: list[str]) -> set[str]:
    by = {line.name: line for line in p.lines}
    needed, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        line = by.get(name)
        if line is None or not line.vec or name in needed:
            continue
        needed.add(name)
        stack.extend(line.deps)
    return needed


def _assign(line: Line) -> str:
    return f"{line.name} = {line.expr}" + (f"  # {line.note}" if line.note else "")
