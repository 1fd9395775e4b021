"""The cost model's formulas as sympy expressions, with a model's measured coefficients filled in.

``formulas(profile)`` gives per-rank bytes and FLOPs as functions of the plan's symbols (B global
batch, S sequence, dp, tp, pp, cp, mb, zero) for plans without recompute, fp32, sp as given: what
``estimate`` computes numerically, written so a person can read (and docs/cost_model.md prints) it.
Pipeline stages are taken as equal (1/pp of every layer term); ``estimate`` uses the real cut.

    >>> from usc.compiler.cost_formulas import SYMBOLS
    >>> sorted(SYMBOLS)[:3]
    ['B', 'S', 'cp']
"""

from __future__ import annotations

import sympy

from .cost_model import ModelProfile

SYMBOLS = {name: sympy.Symbol(name, positive=True) for name in ("B", "S", "dp", "tp", "pp", "cp", "mb", "zero")}


def _coefficients(buckets: dict, profile: ModelProfile) -> tuple[float, float, float, float, float]:
    """Bytes per token (batch and sequence), per token split by tp, per position, per sequence, constant."""
    tok = tok_tp = pos = seqs = const = 0.0
    tokens = profile.batch * profile.seq
    for key, amount in buckets.items():
        if key.batch and key.seq:
            if key.tp:
                tok_tp += amount / tokens
            else:
                tok += amount / tokens
        elif key.seq:
            pos += amount / profile.seq
        elif key.batch:
            seqs += amount / profile.batch
        else:
            const += amount
    return tok, tok_tp, pos, seqs, const


def formulas(profile: ModelProfile, *, sp: bool = False) -> dict[str, sympy.Expr]:
    """Bytes of params/grads/optimizer/activations and FLOPs per rank per step, symbolically."""
    B, S, dp, tp, pp, cp, mb, zero = (SYMBOLS[n] for n in ("B", "S", "dp", "tp", "pp", "cp", "mb", "zero"))
    p_rep, p_tp = profile.param_bytes
    params = (sympy.Integer(p_rep) + sympy.Integer(p_tp) / tp) / pp
    sharded = params / dp
    acts: dict = {}
    for u in profile.units:
        for key, amount in u.acts.get(sp, {}).items():
            acts[key] = acts.get(key, 0) + amount
    tok, tok_tp, pos, seqs, const = (sympy.Float(c, 6) for c in _coefficients(acts, profile))
    in_flight = sympy.Min(pp, mb)  # 1F1B; 1 without pp (pp=1 -> Min(1, mb) = 1)
    per_mb = (B / (dp * mb)) * ((S / cp) * (tok + tok_tp / tp) + seqs) + (S / cp) * pos + const
    tokens = profile.batch * profile.seq
    f_mm = sympy.Float(sum(u.flops_matmul for u in profile.units) / tokens, 6)
    f_attn = sympy.Float(sum(u.flops_attention for u in profile.units) / (tokens * profile.seq), 6)
    return {
        "params": sympy.Piecewise((sharded, sympy.Ge(zero, 3)), (params, True)),
        # ZeRO-1 holds whole gradients only while microbatches accumulate (a pipeline's stage always)
        "grads": sympy.Piecewise((sharded, sympy.Or(sympy.Ge(zero, 2),
                                                    sympy.And(sympy.Eq(zero, 1), sympy.Eq(mb, 1), sympy.Eq(pp, 1)))),
                                 (params, True)),
        "optimizer": 2 * sympy.Piecewise((sharded, sympy.Ge(zero, 1)), (params, True)),
        "activations": per_mb / pp * in_flight,
        "flops": 3 * (f_mm * B * S + f_attn * B * S**2) / (dp * tp * pp * cp),
    }


def evaluate(expr: sympy.Expr, **values) -> float:
    return float(expr.subs({SYMBOLS[k]: v for k, v in values.items()}))


__all__ = ["SYMBOLS", "formulas", "evaluate"]
