"""Any plan over the landed dimensions either compiles for the tiny models or is refused with a
PlanError that points at the plan — never another exception from deep inside."""

import pytest
from hypothesis import find, given, settings
from hypothesis.errors import NoSuchExample

import usc
from usc.testing.models import LlamaConfig, TinyLlama, seeded, token_batch
from usc.testing.strategies import plans

MODEL = LlamaConfig(layers=4)


def _model() -> TinyLlama:
    """The same weights every example (the global RNG left as it was): the plans differ, the model
    does not, so the trace memo (tests/conftest.py) traces it once instead of once per example."""
    return seeded(TinyLlama, MODEL)


@given(plan=plans(max_ranks=16, fuse=True, dtype=True))  # compile only: fusion's kernels never run here
@settings(max_examples=15, deadline=None)
def test_every_plan_compiles_or_is_a_plan_error(plan):
    try:
        report = usc.lint(_model(), plan, example_inputs=token_batch(128, 16, 32))
    except usc.PlanError as err:
        assert err.line >= 1 and err.column >= 1
        return
    assert report.mesh.world_size == usc.parse_plan(plan).world_size


def test_the_plan_strategy_draws_what_it_is_asked_to():
    """plans(dtype=True) draws bf16 compute (and bf16 gradient sums); without it, never; the same for
    fuse=on and ep: a suite that asks for a dimension is sure to be offered it."""
    asked = settings(max_examples=300, database=None)
    assert "dtype=bf16" in find(plans(dtype=True), lambda p: "dtype=bf16" in p, settings=asked)
    assert "reduce_dtype=bf16" in find(plans(dtype=True), lambda p: "reduce_dtype=bf16" in p, settings=asked)
    assert "fuse=on" in find(plans(fuse=True), lambda p: "fuse=on" in p, settings=asked)
    assert "ep=" in find(plans(experts=True), lambda p: "ep=" in p, settings=asked)
    never = settings(max_examples=50, database=None)
    for word in ("dtype=", "fuse=", "ep="):
        with pytest.raises(NoSuchExample):
            find(plans(), lambda p, word=word: word in p, settings=never)
