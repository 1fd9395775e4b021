"""Evaluation as the model's own ``eval()`` computes it.

usc traces the training forward and evaluates with that program, dropout off (``EvalMode``). A model
whose evaluation differs in more than dropout -- batch norm's running statistics, a branch on
``self.training`` (stochastic depth, a router's jitter, a layer drop, a scale) -- would be evaluated
with its training forward, silently. So the first evaluation in eval mode traces the model in
evaluation mode on that batch and compares the program op by op with the training one, dropout
aside; where they differ, the evaluation is refused by name (``EvalModeError``) instead of answering
with the training forward."""

from __future__ import annotations

import contextlib
import difflib
import operator

import torch
from torch import fx

from usc.compiler.errors import CompileError

aten = torch.ops.aten


class EvalModeError(RuntimeError):
    """The model computes differently in evaluation mode than in training beyond dropout, and the
    compiled program evaluates with the training forward (dropout off)."""


# Dropout in its forms (the mode's difference the program follows: passes/random_ops.py keeps every
# element in evaluation), and ops that pass their input through in one mode and are absent in the other.
_DROPOUT = {aten.dropout.default, aten.native_dropout.default, aten.feature_dropout.default,
            aten.alpha_dropout.default, aten.feature_alpha_dropout.default}
_PASS_THROUGH = {aten.clone.default, aten.alias.default, aten.detach.default, aten.lift_fresh_copy.default}
_DROPOUT_ARGS = {"dropout_p"}  # attention's own dropout: off in evaluation, as the program runs it


def _literal(value):
    """A node argument as compared: nodes stand for their place in the dataflow, not themselves."""
    if isinstance(value, fx.Node):
        return "<node>"
    if isinstance(value, (list, tuple)):
        return tuple(_literal(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _literal(v)) for k, v in value.items()))
    return value


def _ops(gm: fx.GraphModule) -> list:
    """[(op, its non-tensor arguments, the node)] of the program's computation, dropout aside."""
    out = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node.target in _DROPOUT or node.target in _PASS_THROUGH:
            continue
        schema = getattr(node.target, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        named = [(names[i] if i < len(names) else str(i), a) for i, a in enumerate(node.args)]
        named += sorted(node.kwargs.items())
        out.append((node.target, tuple((n, _literal(a)) for n, a in named if n not in _DROPOUT_ARGS), node))
    return out


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "the model's own forward"
    path, kind = list(stack.values())[-1]
    kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return f"module '{path}' ({kind.rsplit('.', 1)[-1]})"


def _name(op) -> str:
    return str(op).replace("aten.", "", 1)


def mode_difference(training: fx.GraphModule, evaluating: fx.GraphModule) -> str:
    """Where the evaluation program first departs from the training one, dropout aside ("" where the
    two compute the same): the module and the ops each mode runs there."""
    train_ops, eval_ops = _ops(training), _ops(evaluating)
    keys = lambda ops: [(op, args) for op, args, _ in ops]  # noqa: E731
    matcher = difflib.SequenceMatcher(a=keys(train_ops), b=keys(eval_ops), autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        node = (train_ops[i1] if i1 < i2 else eval_ops[j1])[2]
        if tag == "replace" and i2 - i1 == 1 and j2 - j1 == 1 and train_ops[i1][0] == eval_ops[j1][0]:
            changed = [n for (n, a), (_, b) in zip(train_ops[i1][1], eval_ops[j1][1]) if a != b] or ["argument"]
            return f"{_where(node)} runs {_name(train_ops[i1][0])} with another {changed[0]} in evaluation"
        shown = lambda ops: ", ".join(_name(op) for op, _, _ in ops[:3]) + (", ..." if len(ops) > 3 else "")  # noqa: E731
        train_part, eval_part = train_ops[i1:i2], eval_ops[j1:j2]
        if not eval_part:
            return f"{_where(node)} runs {shown(train_part)} in training only"
        if not train_part:
            return f"{_where(node)} runs {shown(eval_part)} in evaluation only"
        return f"{_where(node)} runs {shown(train_part)} in training where evaluation runs {shown(eval_part)}"
    return ""


class _DropoutOff(torch.overrides.TorchFunctionMode):
    """The training forward with its dropout at zero, as the program evaluates it: dropout calls pass
    their input through and attention's ``dropout_p`` is 0 -- so a model that chooses another
    attention kernel with dropout on traces to the kernel its evaluation runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUT_FUNCTIONS:
            return args[0] if args else kwargs["input"]
        if func is torch.nn.functional.scaled_dot_product_attention:
            if len(args) > 4:
                args = (*args[:4], 0.0, *args[5:])
            elif "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


_DROPOUT_FUNCTIONS = {torch.nn.functional.dropout, torch.nn.functional.dropout1d, torch.nn.functional.dropout2d,
                      torch.nn.functional.dropout3d, torch.nn.functional.alpha_dropout,
                      torch.nn.functional.feature_alpha_dropout, torch.dropout, torch.alpha_dropout,
                      torch.feature_dropout, torch.feature_alpha_dropout}


def _uses_batch_statistics(gm: fx.GraphModule) -> str:
    """A batch norm in its training form (the one mode difference a graph shows by itself)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and "batch_norm" in str(node.target) and "no_training" not in str(node.target):
            return _where(node)
    return ""


def check(program, batch: tuple, call: str) -> None:
    """Refuse ``call`` (an evaluation in eval mode) when the model's evaluation is not its training
    forward with dropout off. Decided once per program, on the first such call: the model traced in
    evaluation mode on ``batch`` and compared with the program's own trace, and where they differ
    (dropout's kernels, another batch's shapes) with the model traced in training mode, dropout at
    zero, on the same batch; with the model gone (nothing left to trace), a batch norm's training form
    in the compiled program decides."""
    verdict = getattr(program, "_eval_form", None)
    if verdict is None:
        verdict = program._eval_form = _decide(program, batch)
    if verdict:
        raise EvalModeError(
            f"{call}: the model computes differently in evaluation mode than the compiled program's training "
            f"forward with dropout off -- {verdict}: the program would evaluate with the training forward, "
            "with no error\n"
            "  fix: evaluate with the model itself (model.load_state_dict(step.full_state_dict()); model.eval(); "
            "model(...)), or step.train() first to evaluate the training forward (no update is taken)")


def _decide(program, batch: tuple) -> str:
    from usc.compiler.trace import trace
    from usc.model_call import trainable

    model = program._user_model_alive()
    if model is None:
        traced = getattr(program, "_traced", None)
        where = _uses_batch_statistics(traced.gm) if traced is not None else ""
        return f"{where} normalises with the batch's statistics in training" if where else ""
    microbatch = program._microbatch(batch)
    loss_fn = getattr(program, "_loss_fn", None)

    def trace_in(mode: bool) -> fx.GraphModule:
        model.train(mode)
        wrapped = trainable(model, loss_fn)
        wrapped.layout = program.model.layout  # the batch as the program reads it
        with _DropoutOff() if mode else contextlib.nullcontext():
            return trace(wrapped, microbatch, wrapper_source=program._loss_source).gm

    was = model.training
    try:
        evaluating = trace_in(False)
        built = getattr(program, "_traced", None)  # the program's own trace: the same where nothing differs
        if built is not None and not mode_difference(built.gm, evaluating):
            return ""
        return mode_difference(trace_in(True), evaluating)
    except CompileError as err:
        return f"the model in evaluation mode does not trace as in training ({str(err).splitlines()[0]})"
    finally:
        model.train(was)
