"""Errors raised while compiling a model (the plan's own errors are ``usc.dsl.PlanError``)."""

from __future__ import annotations


class CompileError(ValueError):
    """The model cannot be compiled as asked; the message names the module, the op and a fix."""


class TraceError(CompileError):
    """The tracer could not turn the model into a graph."""


class ShardingError(CompileError):
    """A sharding rule cannot place an op; carries the node so callers can name its module.

    ``module`` and ``source`` are filled in by the propagation pass, which knows the node.
    """

    def __init__(self, message: str, *, hint: str = "") -> None:
        super().__init__(message)
        self.reason = message
        self.hint = hint


class UnsupportedOpError(ShardingError):
    """No link of the rule chain (hand rule, DTensor strategy, decomposition, replicated) can place
    an op: a property of the model's graph, never a mistake in the plan text."""
