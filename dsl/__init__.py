"""usc.dsl — the plan language: text like ``dp=2 tp=4 zero=1 lm_head: vocab`` to validated values.

>>> from usc.dsl import parse_plan
>>> plan = parse_plan("dp=2 tp=4 schedule=1f1b lm_head: vocab, recompute")
>>> plan.mesh_axes, plan.mesh_shape, plan.get("zero"), str(plan.rules[0])
(('dp', 'tp'), (2, 4), 0, 'lm_head: vocab, recompute')

Depends only on the standard library and lark (no torch, nothing else of usc).
"""

from .errors import PlanError
from .options import ACTIONS, AXES, OPTIONS
from .parser import load_plan, parse_plan
from .plan import Action, Plan, Rule, check_rules_match

__all__ = [
    "ACTIONS",
    "AXES",
    "OPTIONS",
    "Action",
    "Plan",
    "PlanError",
    "Rule",
    "check_rules_match",
    "load_plan",
    "parse_plan",
]
