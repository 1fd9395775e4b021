"""Op coverage of the "models users bring" tier: every op in the traced training programs of its
families (tests/distributed/users_models.py: Hugging Face families from config objects, torchtitan- and
nanoGPT-style models, each called as its users call it) has a link of the rule chain that places it
under a batch shard. Trace only, one small config per family: no pass runs, nothing trains (the deep
tier's ``test_every_op_keeps_the_batch_shard`` lints each family under dp=2 for gathers)."""

import os
import sys

import pytest
import torch

from usc.passes.derived_rules import DECOMPOSED, DRAWN, DTENSOR, HAND, NONE, REPLICATED, derived_rule, rule_link
from usc.passes.sharding_rules import OpView

pytest.importorskip("transformers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "distributed"))

from users_models import ALIKE_LAYERS, FAMILIES, traced_ops  # noqa: E402

aten = torch.ops.aten
# Ops the tier's traces hold that no rule places, each with the family that brings it and why usc
# refuses it by name (none today).
KNOWN_UNPLACED: dict = {}
# Ops with no tensor input that depends on the batch (factories, shape checks, constants from
# arange/full): "replicated" is their exact placement, not a gather of a batch-sharded input.
NO_BATCH_INPUT = {aten._assert_tensor_metadata.default, aten.arange.default, aten.arange.start,
                  aten.arange.start_step, aten.full.default, aten.ones.default, aten.zeros.default}


@pytest.fixture(scope="module")
def ops_by_family() -> dict[str, frozenset]:
    # the decoders whose layers are all alike (users_models.ALIKE_LAYERS) at one layer, which traces
    # the ops two do in about 60% of the time (test_one_layer_traces_the_ops_of_two, deep tier)
    return {family: traced_ops(family, 1 if family in ALIKE_LAYERS else None) for family in FAMILIES}


@pytest.mark.skipif(os.environ.get("USC_DEEP_TIER") != "1", reason="deep tier: set USC_DEEP_TIER=1 (each "
                    "family of ALIKE_LAYERS traced again at LAYERS; test_every_op_of_the_tier_has_a_rule covers "
                    "their ops in CI)")
@pytest.mark.parametrize("family", ALIKE_LAYERS)
def test_one_layer_traces_the_ops_of_two(family):
    assert traced_ops(family, 1) == traced_ops(family)


def test_every_op_of_the_tier_has_a_rule(ops_by_family):
    unplaced = {f"{op} ({family})" for family, ops in ops_by_family.items() for op in ops
                if rule_link(op) == NONE and KNOWN_UNPLACED.get(op) != family}
    assert not unplaced, f"ops of the tier no link of the rule chain places: {sorted(unplaced)}"


def test_batch_dependent_ops_are_not_left_to_replication(ops_by_family):
    """An op left to the "replicated" link gathers a batch-sharded input under dp. The ones the tier
    holds either take no batch input or are opaque library ops whose rows are coupled (HF's grouped_mm
    fallback runs on tokens sorted by expert over the whole batch: ep recognises the block instead)."""
    coupled = {"transformers.grouped_mm_fallback.default"}
    replicated = {str(op) for ops in ops_by_family.values() for op in ops
                  if rule_link(op) == REPLICATED and op not in NO_BATCH_INPUT}
    assert replicated <= coupled | {"aten.floor_divide.default", "aten.polar.default"}, sorted(replicated - coupled)


def test_known_unplaced_ops_are_still_in_the_tier(ops_by_family):
    """A known refusal that left the tier (a family changed, or the op gained a rule) is stale here."""
    for op, family in KNOWN_UNPLACED.items():
        assert op in ops_by_family[family] and rule_link(op) == NONE, op


def test_phimoe_router_draws_are_counter_based(ops_by_family):
    """PhiMoE's router samples experts with exponential_ while training: a counter-based draw."""
    assert aten.exponential.default in ops_by_family["phimoe"]
    assert rule_link(aten.exponential.default) != NONE


def test_coverage_counts_every_link(ops_by_family):
    """The README's op-coverage figure: most ops by hand rule; DTensor strategies, decompositions and
    counter-based draws all place some."""
    links = {}
    for ops in ops_by_family.values():
        for op in ops:
            links.setdefault(rule_link(op), set()).add(op)
    assert {HAND, DTENSOR, DECOMPOSED, DRAWN} <= set(links)
    assert len(links[HAND]) > sum(len(v) for k, v in links.items() if k != HAND)


@pytest.mark.parametrize("op, batched", [(aten.index.Tensor, 1), (aten.baddbmm.default, 3), (aten.view_as_real.default, 1)])
def test_derived_rules_keep_a_batch_shard(op, batched):
    """Ops of the tier placed by a derived link keep Shard(0) on their batch-first inputs (the first
    ``batched`` of them; an index vector stays whole) and put out Shard(0): no gather."""
    from torch.distributed.tensor import Replicate, Shard

    node = _node_of(op)
    placements = tuple(Shard(0) if i < batched else Replicate() for i in range(len(_tensor_inputs(node))))
    view = OpView(node, placements, tuple(tuple(x.meta["val"].shape) for x in _tensor_inputs(node)),
                  tuple(node.meta["val"].shape), "dp", 2)
    decision = derived_rule(op)(view)
    assert tuple(decision.inputs) == placements and decision.output == Shard(0), decision


def _node_of(op):
    """A one-op graph with a batch-first input of ``dims`` dims (odd sizes)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    if op is aten.index.Tensor:
        fn, args = (lambda x, i: aten.index.Tensor(x, [None, i])), (torch.randn(6, 5), torch.tensor([0, 3, 4]))
    elif op is aten.baddbmm.default:
        fn, args = (lambda a, b, c: aten.baddbmm.default(a, b, c)), \
            (torch.randn(6, 3, 7), torch.randn(6, 3, 5), torch.randn(6, 5, 7))
    else:
        fn, args = (lambda x: aten.view_as_real.default(x)), (torch.randn(6, 5, dtype=torch.complex64),)
    gm = make_fx(fn, tracing_mode="fake")(*args)
    return next(n for n in gm.graph.nodes if n.op == "call_function" and n.target is op)


def _tensor_inputs(node):
    from usc.passes.graph_edit import flat_inputs

    return flat_inputs(node)
