"""The recompute pass: which nodes are kept, which recomputed, how regions are cut, and what the
report says about them (graph-level; numerics are in tests/distributed/test_recompute_equivalence.py)."""

import pytest
import torch
import torch.fx as fx
from torch import nn

import usc
from usc.build import _Compiled
from usc.compiler.ir import META
from usc.compiler.trace import trace
from usc.runtime.collectives import AllReduce, GradAllReduce
from usc.runtime.recompute import Recompute
from usc.testing.models import (
    DropoutNet, LlamaConfig, MoEConfig, TinyGPT2, TinyLlama, TinyMixtral, seeded, shifted_batch,
    token_batch)

aten = torch.ops.aten
BATCH = token_batch(128, 4, 16)


def program(plan: str, model=None, batch=BATCH):
    torch.manual_seed(0)
    return _Compiled(model or TinyLlama(), plan, example_inputs=batch).program


def llama() -> TinyLlama:
    """TinyLlama() from seed 0 (as ``program`` builds it), the global RNG left as it was: the same
    weights on every call, so the trace memo (tests/conftest.py) traces the model these tests lint
    under several plans once (the report's collectives, bytes and regions read no values)."""
    return seeded(TinyLlama)


def regions(gm: fx.GraphModule) -> list[Recompute]:
    return [m for m in gm.modules() if isinstance(m, Recompute)]


def decided(body: fx.GraphModule, decision: str) -> list[fx.Node]:
    return [n for n in body.graph.nodes if n.op != "placeholder" and n.meta.get(META)
            and n.meta[META].extra.get("recompute") == decision]


def test_selective_keeps_matmul_outputs_and_recomputes_norms_attention_and_activations():
    gm = program("recompute=selective").gm
    found = regions(gm)
    assert [r.label for r in found] == ["layers.0", "layers.1"]  # one region per block (no collectives)
    for region in found:
        kept = {n.target for n in decided(region.body, "kept")}
        recomputed = {n.target for n in decided(region.body, "recomputed")}
        assert kept == {aten.linear.default}
        assert len(decided(region.body, "kept")) == 7  # q, k, v, o, gate, up, down
        assert {aten.scaled_dot_product_attention.default, aten.silu.default, aten.rsqrt.default,
                aten.pow.Tensor_Scalar, aten.mean.dim} <= recomputed
        assert set(region.kept) == {n.name for n in decided(region.body, "kept")}
    outside = [n for n in gm.graph.nodes if n.target is aten.linear.default]
    assert len(outside) == 1 and outside[0].meta[META].module == "lm_head"  # not in a block: untouched


def test_full_puts_each_whole_block_in_one_region_including_its_collectives():
    gm = program("tp=2 recompute=full").gm
    found = regions(gm)
    assert [r.label for r in found] == ["layers.0", "layers.1"]
    for region in found:
        assert not region.kept and not decided(region.body, "kept")
        kinds = [type(m) for m in region.body.modules() if isinstance(m, (AllReduce, GradAllReduce))]
        assert kinds.count(AllReduce) == 2 and kinds.count(GradAllReduce) == 2  # re-issued in backward
        inputs = [n for n in region.body.graph.nodes if n.op == "placeholder"
                  and n.meta["usc_region_input"] == "activation"]
        assert [tuple(n.meta["val"].shape) for n in inputs if n.meta["val"].dim() == 3] == [(4, 16, 64)]


def test_selective_never_puts_a_communicating_collective_in_a_region():
    gm = program("dp=2 tp=2 recompute=selective").gm
    in_regions = [m for r in regions(gm) for m in r.body.modules()]
    assert not any(isinstance(m, AllReduce) for m in in_regions)  # forward all-reduce: output kept
    assert any(isinstance(m, GradAllReduce) for m in in_regions)  # f is the identity forward
    top = [gm.get_submodule(n.target) for n in gm.graph.nodes if n.op == "call_module"]
    assert sum(isinstance(m, AllReduce) for m in top) >= 4


def test_report_counts_the_collectives_full_recompute_issues_again():
    plain = usc.lint(llama(), "tp=2", example_inputs=BATCH)
    full = usc.lint(llama(), "tp=2 recompute=full", example_inputs=BATCH)
    selective = usc.lint(llama(), "tp=2 recompute=selective", example_inputs=BATCH)
    in_blocks = plain.count("all-reduce", axis="tp", direction="forward", module_prefix="layers.")
    assert in_blocks == 4
    # the attention's all-reduce runs again; the MLP's closes the block after its last op that saves a
    # tensor, where checkpointing stops recomputing (early stop), so it runs once
    again = [c for c in full.collectives if "re-issued" in c.reason]
    assert [(c.module, c.direction) for c in again] == [
        (f"layers.{i}.self_attn.o_proj", "backward") for i in (0, 1)]
    assert full.count("all-reduce", axis="tp", direction="backward") == len(again) + plain.count(
        "all-reduce", axis="tp", direction="backward")
    assert selective.count(axis="tp") == plain.count(axis="tp")


@pytest.mark.parametrize("plan, again", [
    ("tp=2 sp=on recompute=full", [("all-gather", "self_attn.q_proj"), ("reduce-scatter", "self_attn.o_proj"),
                                   ("all-gather", "mlp.gate_proj")]),
    ("cp=2 recompute=full", [("send/recv", "self_attn")]),
])
def test_full_recompute_reissues_the_collectives_before_a_blocks_last_saving_op(plan, again):
    """sp: both all-gathers and the attention's reduce-scatter, not the MLP's; cp: the ring (which
    saves its own q, k, v and output, so its sends run before the save that stops recomputation)."""
    report = usc.lint(llama(), plan, example_inputs=BATCH)
    reissued = [(c.kind, c.module) for c in report.collectives if "re-issued" in c.reason]
    assert reissued == [(kind, f"layers.{i}.{module}") for i in (0, 1) for kind, module in again]


def test_a_recompute_rule_marks_only_its_modules():
    gm = program("layers.*.mlp: recompute").gm
    found = regions(gm)
    assert [r.label for r in found] == ["layers.0", "layers.1"]
    for region in found:
        modules = {n.meta[META].module for n in region.body.graph.nodes if n.op.startswith("call")}
        assert modules and all(".mlp" in m for m in modules)
        assert not decided(region.body, "kept")


def test_zero3_gathers_stay_outside_regions():
    gm = program("dp=2 zero=3 recompute=full").gm
    names = {type(m).__name__ for r in regions(gm) for m in r.body.modules()}
    assert not names & {"ZeroFetch", "ZeroGather"}
    top = {type(gm.get_submodule(n.target)).__name__ for n in gm.graph.nodes if n.op == "call_module"}
    assert {"ZeroFetch", "ZeroGather", "Recompute"} <= top


def test_pipeline_stages_get_their_own_regions():
    gm = program("pp=2 mb=2 recompute=selective").gm
    labels = sorted(r.label for r in regions(gm))
    assert labels == ["layers.0", "layers.1"]
    stages = [m for name, m in gm.named_children() if isinstance(m, fx.GraphModule)]
    assert all(regions(stage) for stage in stages)


def test_draws_are_recomputed_from_a_key_made_once():
    """usc's counter-based draws (dropout is a draw times the input, passes/random_ops.py) are inside
    the regions, recomputed like any op; their keys, which read the executor's step and microbatch,
    stay outside, made once and kept, so a recomputed draw hashes the forward's key."""
    from usc.runtime.random import RandomKey

    batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    gm = program("recompute=full", DropoutNet(p=0.3), batch).gm
    found = regions(gm)
    assert found
    draw = torch.ops.usc.draw.default
    inside = [n for region in found for n in region.body.graph.nodes if n.target is draw]
    assert len(inside) == 2
    keys = [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), RandomKey)]
    assert len(keys) == 2 and all(n.meta[META].extra["recompute"] == "boundary" for n in keys)
    for region in found:
        assert not any(n.op == "call_module" and isinstance(region.body.get_submodule(n.target), RandomKey)
                       for n in region.body.graph.nodes)


def test_report_lists_saved_and_recomputed_tensors_with_bytes():
    report = usc.lint(llama(), "recompute=selective", example_inputs=BATCH)
    summary = report.recompute_summary
    b, s, h = 4, 16, 64
    assert summary["input"]["bytes"] >= 2 * b * s * h * 4  # each block's input
    # kept per block: q (64) + k, v (32 each) + o (64) + gate, up (128 each) + down (64) columns, float32
    assert summary["kept"]["bytes"] == 2 * b * s * (64 + 32 + 32 + 64 + 128 + 128 + 64) * 4
    assert summary["recomputed"]["ops"]["scaled_dot_product_attention"] == 2
    text = str(report)
    assert "recompute=selective" in text and "saved (matmul outputs)" in text
    assert "none" in text and "<- this plan" in text.split("by recompute mode")[1]
    assert report.to_dict()["recompute"]["summary"]["kept"]["tensors"] == 14


def test_activation_prediction_by_mode_orders_none_selective_full():
    report = usc.lint(TinyGPT2(), "dp=2", example_inputs=shifted_batch(128, 4, 16))
    by_mode = report.activation_bytes_by_recompute
    assert by_mode["none"] == report.activation_bytes
    assert by_mode["none"] > by_mode["selective"] > by_mode["full"]


@pytest.mark.parametrize("plan", ["recompute=full", "recompute=selective", "layers.*: recompute"])
def test_recompute_plans_compile_and_print(plan):
    report = usc.lint(TinyLlama(LlamaConfig(layers=1)), plan, example_inputs=BATCH)
    assert report.recompute


class InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        h = self.a(x)
        h.add_(0.1)  # an in-place op inside the block
        return x + self.b(torch.relu(h))


class InPlaceNet(DropoutNet):
    def __init__(self) -> None:
        super().__init__(p=0.3)
        self.layers = nn.ModuleList(InPlaceBlock() for _ in range(2))


def test_in_place_ops_are_dataflow_and_recompute_safely():
    """The tracer functionalizes writes (compiler/functional.py): the in-place add is a plain add a
    recomputation may rerun, and no in-place op is left to change a tensor twice."""
    batch = (torch.randint(0, 32, (2, 8)), torch.randint(0, 32, (2, 8)))
    traced = trace(InPlaceNet(), batch).gm
    assert len([n for n in traced.graph.nodes if n.target is aten.add.Tensor and 0.1 in n.args]) == 2
    gm = program("recompute=full", InPlaceNet(), batch).gm
    everything = [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes]
    assert not [n for n in everything if n.target is aten.add_.Tensor]
    assert regions(gm)
    from usc.testing import assert_equivalent
    assert_equivalent(InPlaceNet, "recompute=full", [batch], steps=2)


def test_under_full_recompute_the_rules_of_a_plan_without_cp_or_tp_decide_nothing():
    """The planner's profile asks the recompute pass once per probe under full recompute and reads
    that answer for plans with and without cp and tp: the rules those plans add (ring attention read
    as local attention, an absent axis's collectives as identities) sit after full's own rule. Held
    here against asking with each set of rules, on the probe of a Llama and of a mixture of experts."""
    from usc.compiler.moe import traced_blocks
    from usc.passes.cost_profile import RULES_WITHOUT_CP, _probe_programs, _without
    from usc.passes.recompute import RULES, recompute_regions

    torch.manual_seed(0)
    llama = TinyLlama(LlamaConfig(vocab=66, hidden=36, heads=6, kv_heads=2, mlp=42, layers=2, max_seq=16))
    moe = TinyMixtral(), token_batch(MoEConfig().vocab, 2, 8)
    for model, batch in ((llama, token_batch(66, 2, 10)), moe):
        traced = trace(model, batch, moe_blocks=traced_blocks(model))
        _, probe = _probe_programs(traced, 2, batch[0].shape[1])
        assert {"cp", "tp"} <= set(probe.mesh.axes)

        def asked(rules, mode="full"):
            regions, decisions, _ = recompute_regions(probe.gm, mode, lambda path: False, rules=rules)
            return [[n.name for n in run] for run in regions], {n.name: d for n, d in decisions.items()}

        once = asked(RULES)
        for absent in (frozenset(), frozenset({"cp"}), frozenset({"tp"}), frozenset({"cp", "tp"})):
            for rules in (RULES, RULES_WITHOUT_CP):
                assert asked(_without(absent, rules)) == once
        # and under selective they do decide: the answers differ, so the comparison above can fail
        without = _without(frozenset({"cp", "tp"}), RULES_WITHOUT_CP)
        assert asked(without, "selective") != asked(RULES, "selective")
