"""usc: a declarative model compiler and auto-parallelizer for PyTorch training.

    step = usc.compile(model, "dp=2 tp=2", example_inputs=(tokens, labels))
    loss = step.step(tokens, labels)
"""

from usc.compiler.errors import CompileError, ShardingError, TraceError
from usc.compiler.report import CollectiveRecord, Report
from usc.dsl import Plan, PlanError, load_plan, parse_plan
from usc.runtime.checkpoint import CheckpointError
from usc.runtime.agreement import RanksDisagree
from usc.runtime.errors import CollectiveError, CollectiveTimeout, NonFiniteLoss
from usc.runtime.input_checks import BadInput, InputDtypeError, InputOutOfRange
from usc.handover import ModelChanged, ModelOutOfDate
from usc.eval_form import EvalModeError
from usc.runtime.materialize import InitError, materialize

from . import data, training
from .version import __version__
from .api import Compiled, Simulated, StepContextError, compile, lint, plan, simulate

__all__ = ["compile", "simulate", "lint", "plan", "parse_plan", "load_plan", "Plan", "PlanError", "CompileError",
           "TraceError", "ShardingError", "CollectiveError", "CollectiveTimeout", "Compiled", "Simulated",
           "Report", "CollectiveRecord", "CheckpointError", "NonFiniteLoss", "BadInput", "InputOutOfRange",
           "InputDtypeError", "RanksDisagree", "InitError", "materialize", "ModelOutOfDate",
           "ModelChanged", "StepContextError", "EvalModeError"]
