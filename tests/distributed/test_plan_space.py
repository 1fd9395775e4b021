"""Any plan over the landed dimensions either compiles for the tiny models or is refused with a
PlanError that points at the plan — never another exception from deep inside."""

from hypothesis import given, settings

import usc
from usc.testing.models import LlamaConfig, TinyLlama, token_batch
from usc.testing.strategies import plans

MODEL = LlamaConfig(layers=4)


@given(plan=plans(max_ranks=16, fuse=True, dtype=True))  # compile only: fusion's kernels never run here
@settings(max_examples=15, deadline=None)
def test_every_plan_compiles_or_is_a_plan_error(plan):
    try:
        report = usc.lint(TinyLlama(MODEL), plan, example_inputs=token_batch(128, 16, 32))
    except usc.PlanError as err:
        assert err.line >= 1 and err.column >= 1
        return
    assert report.mesh.world_size == usc.parse_plan(plan).world_size
