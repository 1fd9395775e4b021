"""The planner and the cost model's schedule formulas, on the tiny Llama's measured profile."""

from dataclasses import replace

import pytest
import torch

import usc
from usc.compiler.cost_model import PlanPoint, bubble_units, crosses_node, estimate, in_flight, zb_program
from usc.compiler.hardware import H100
from usc.compiler.planner import TIE, PlanTarget, _microbatches, search, simplicity
from usc.passes.pipeline_schedule import build_schedule
from usc.passes.pipeline_schedule_check import check_schedule
from usc.passes.plan_checks import check_supported
from usc.planning import refusal
from usc.passes.cost_profile import profile_model
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

CONFIG = LlamaConfig(layers=4)


@pytest.fixture(scope="module")
def profile():
    return profile_model(TinyLlama(CONFIG), token_batch(CONFIG.vocab, 8, 32))


@pytest.mark.parametrize("schedule, pp, mb", [("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 4, 2), ("zb", 4, 8),
                                              ("1f1b", 2, 6), ("1f1b", 3, 5)])
def test_schedule_formulas_match_the_schedule_checker(schedule, pp, mb):
    metrics = check_schedule(build_schedule(schedule, pp, 1, mb))
    point = PlanPoint(64, 32, pp=pp, mb=mb, schedule=schedule)
    assert [in_flight(point, k) for k in range(pp)] == list(metrics.peak_in_flight)  # every rank's
    assert bubble_units(point) / mb == pytest.approx(metrics.bubble_ratio, rel=1e-9)


@pytest.mark.parametrize("pp, v, mb", [(4, 2, 8), (2, 2, 4), (2, 3, 6)])
def test_interleaved_in_flight_matches_the_schedule_on_every_rank(pp, v, mb):
    """In chunk-microbatches (each 1/v of a rank's activations), rank k holds p*v + p - 1 - 2k."""
    metrics = check_schedule(build_schedule("interleaved", pp, v, mb))
    point = PlanPoint(64, 32, pp=pp, mb=mb, schedule="interleaved", v=v)
    assert [in_flight(point, k) * v for k in range(pp)] == list(metrics.peak_in_flight)


def test_tp_inside_a_node_and_dp_across_nodes():
    point = PlanPoint(64, 32, dp=4, tp=8, gpus_per_node=8)
    assert not crosses_node(point, "tp") and crosses_node(point, "dp")
    assert crosses_node(replace(point, dp=1, tp=16, gpus_per_node=8), "tp")


def test_time_terms_add_up_and_give_tokens_per_second(profile):
    est = estimate(profile, PlanPoint(8, 32, dp=2, tp=2, pp=2, mb=2, sp=True), H100)
    parts = ("compute", "host", "exposed_comm", "bubble", "optimizer")
    assert est.time["step"] == pytest.approx(sum(est.time[k] for k in parts))
    assert est.tokens_per_second == pytest.approx(8 * 32 / est.time["step"])
    assert 0 < est.mfu < 1 and est.time["bubble"] > 0


def test_planner_proposes_only_what_compile_runs(profile):
    result = search(profile, PlanTarget(gpus=8, seq=32, global_batch=8, dtype="fp32"), H100, supported=refusal)
    for candidate in [result.best] + result.alternatives:
        check_supported(usc.parse_plan(candidate.plan.text()))  # raises if compile would refuse it
    assert any(reason.startswith("not supported yet") for reason in result.rejected)
    assert all(c.step >= result.best.step for c in result.alternatives)
    assert all(result.why_lost(c).startswith("+") for c in result.alternatives)


def test_divisibility_and_memory_drop_plans(profile):
    tiny = replace(H100, name="tiny", hbm_bytes=2_000_000)  # about the whole model's AdamW state
    result = search(profile, PlanTarget(gpus=8, seq=32, global_batch=8, dtype="fp32"), tiny, supported=refusal)
    assert any("tp=4 does not divide" in r for r in result.rejected)  # kv_heads=2
    assert result.rejected["does not fit in memory"] > 0
    assert result.best.estimate.memory_total <= 0.9 * tiny.hbm_bytes
    unsharded = estimate(profile, PlanPoint(8, 32, dp=8), tiny).memory_total
    assert unsharded > 0.9 * tiny.hbm_bytes  # so the chosen plan had to shard something


def test_written_axes_are_kept(profile):
    result = search(profile, PlanTarget(gpus=4, seq=32, global_batch=8, fixed=(("tp", 2),)), H100,
                    supported=refusal)
    assert result.best.plan.tp == 2 and all(c.plan.tp == 2 for c in result.alternatives)


def test_usc_plan_returns_a_plan_with_its_reasons():
    plan = usc.plan(TinyLlama(CONFIG), "gpus=4 zero=1", example_inputs=token_batch(CONFIG.vocab, 8, 32))
    assert isinstance(plan, usc.Plan) and plan.world_size == 4 and not plan.auto
    assert plan.get("zero") == 1 and plan.size("dp") > 1
    best = plan.search.best.plan.text()
    assert usc.parse_plan(best).axes == plan.axes and f"chosen: {usc.parse_plan(best)}" in str(plan.search)


def test_no_plan_fits_is_a_plan_error():
    with pytest.raises(usc.PlanError, match="no plan for 2 GPUs fits"):
        usc.plan(TinyLlama(CONFIG), "gpus=2", example_inputs=token_batch(CONFIG.vocab, 8, 32),
                 hardware=replace(H100, name="none", hbm_bytes=1000))


def test_microbatch_counts_are_the_batchs_divisors_and_a_written_one_is_kept_or_refused_by_name(profile):
    """A replica's 6 sequences run as 1, 2, 3 or 6 microbatches, not only powers of two; a written
    mb is the one count tried, and one that does not divide the batch says so (before, a written
    mb=3 found nothing and printed an empty reason)."""
    target = PlanTarget(gpus=2, seq=32, global_batch=6, fixed=(("pp", 2), ("mb", 3), ("schedule", "1f1b")))
    result = search(profile, target, H100, supported=refusal)
    assert result.best.plan.mb == 3 and result.best.plan.pp == 2
    assert _microbatches(6, 2) == [2, 3, 6] and _microbatches(96, 1)[:6] == [1, 2, 3, 4, 6, 8]
    assert _microbatches(6, 2, fixed=4) == []
    with pytest.raises(usc.PlanError, match=r"(?s)no plan for 2 GPUs runs what the spec writes:.*mb=4 does not "
                                            r"divide the sequences each dp replica takes \(e\.g\. pp=2 mb=4 .*: 6 "
                                            r"sequences a replica\).*hint: change what the reasons above name"):
        usc.plan(TinyLlama(CONFIG), "gpus=2 pp=2 mb=4", example_inputs=token_batch(CONFIG.vocab, 6, 32))


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5])
def test_the_cost_models_zero_bubble_order_is_the_runtimes(pp):
    """The cost model reads zb's memory off its own writing of ZB-H1 (the compiler does not import
    the runtime's passes): the same actions, in the same order, on every rank, as the builder's."""
    for mb in range(1, 10):
        schedule = build_schedule("zb", pp, 1, mb)
        for rank in range(pp):
            assert zb_program(pp, mb, rank) == [(a.op.value, a.mb) for a in schedule.actions[rank]], (mb, rank)


def test_auto_in_simulate_runs_the_chosen_plan():
    batch = token_batch(CONFIG.vocab, 8, 32)
    torch.manual_seed(0)
    # fuse=off kept as written: fused kernels run in Triton's interpreter on CPU, far too slow here;
    # dtype=fp32 written, so the comparison with one fp32 device is exact
    sim = usc.simulate(TinyLlama(CONFIG), "auto gpus=2 timeout=60 fuse=off dtype=fp32", example_inputs=batch)
    assert sim.plan.world_size == 2 and sim.plan.get("timeout") == 60 and not sim.plan.auto
    assert not sim.plan.get("fuse")
    torch.manual_seed(0)
    one = usc.simulate(TinyLlama(CONFIG), "dp=1", example_inputs=batch)
    assert sim.step(*batch) == pytest.approx(one.step(*batch), rel=1e-5)


def test_without_dtype_the_planner_plans_bf16_and_says_so():
    batch = token_batch(CONFIG.vocab, 8, 32)
    plan = usc.plan(TinyLlama(CONFIG), "gpus=4", example_inputs=batch, hardware="h100")
    assert plan.get("dtype") == "bf16"
    assert "dtype=bf16 assumed" in str(plan.search) and "15x faster than fp32" in str(plan.search)
    written = usc.plan(TinyLlama(CONFIG), "gpus=4 dtype=fp32", example_inputs=batch, hardware="h100")
    assert written.get("dtype") == "fp32" and "assumed" not in str(written.search)
    # a CPU-like profile whose bf16 matmuls are no faster: fp32, and that is said too
    cpu = replace(H100, name="cpu", peak_bf16_flops=50e9, peak_fp32_flops=100e9)
    slow_bf16 = usc.plan(TinyLlama(CONFIG), "gpus=4", example_inputs=batch, hardware=cpu)
    assert slow_bf16.get("dtype") == "fp32" and "dtype=fp32 assumed" in str(slow_bf16.search)


def test_global_batch_governs_dp_not_the_example_batch(profile):
    """An example batch of 2 gives only shapes: global_batch=24 allows dp=8 (and dp=3 for 3 GPUs x 8)."""
    plan = usc.plan(TinyLlama(CONFIG), "gpus=8 global_batch=24 dp=8 dtype=fp32",
                    example_inputs=token_batch(CONFIG.vocab, 2, 32))
    assert plan.size("dp") == 8 and plan.search.target.global_batch == 24
    refused = search(profile, PlanTarget(gpus=8, seq=32, global_batch=12, fixed=(("dp", 8),)), H100)
    assert refused.best is None and any("dp=8 does not divide the global batch 12" in r for r in refused.rejected)


def test_planner_options_need_auto():
    with pytest.raises(usc.PlanError, match="only read with auto"):
        check_supported(usc.parse_plan("dp=2 gpus=2"))
    assert str(usc.parse_plan("gpus=8 auto")) == "auto gpus=8"


@pytest.mark.parametrize("plan", [PlanPoint(8, 32, dp=2), PlanPoint(8, 32, tp=2, zero=0, mb=2),
                                  PlanPoint(16, 64, dp=2, cp=2, zero=2), PlanPoint(8, 32, dp=4, tp=2, zero=3),
                                  PlanPoint(8, 32, dp=2, zero=1, mb=2), PlanPoint(8, 32, dp=2, zero=1, mb=1)])
def test_symbolic_formulas_equal_the_numeric_estimate(profile, plan):
    from usc.compiler.cost_formulas import evaluate, formulas

    est = estimate(profile, plan, H100)
    values = dict(B=plan.global_batch, S=plan.seq, dp=plan.dp, tp=plan.tp, pp=1, cp=plan.cp, mb=plan.mb,
                  zero=plan.zero)
    exprs = formulas(profile)
    for kind in ("params", "grads", "optimizer", "activations"):
        assert evaluate(exprs[kind], **values) == pytest.approx(est.memory[kind], rel=1e-3), kind
    assert evaluate(exprs["flops"], **values) == pytest.approx(est.flops_per_rank, rel=1e-3)


def _moe_profile():
    from usc.compiler.cost_model import ModelProfile, ScaleKey, UnitCost

    hidden = ScaleKey(batch=True, seq=True, tp=False)
    layer = UnitCost("layers.0", balance=1.0, flops_matmul=1e9, params_rep=4_000, params_expert=8 * 1_000_000,
                     acts={False: {hidden: 2**20}}, input_bytes={False: {hidden: 2**16}}, moe_layers=1)
    return ModelProfile("moe", batch=8, seq=32, units=(layer,), layers=1, experts=8)


def test_expert_parallel_splits_experts_and_adds_all_to_alls():
    profile = _moe_profile()
    one = estimate(profile, PlanPoint(8, 32, dp=4), H100)
    ep = estimate(profile, PlanPoint(8, 32, ep=4), H100)
    assert ep.memory["params"] == pytest.approx(4_000 + 8 * 1_000_000 / 4)
    assert one.memory["params"] == pytest.approx(4_000 + 8 * 1_000_000)
    a2a = [c for c in ep.collectives if c.kind == "all-to-all"]
    # per direction: dispatch + combine of top_k copies of this rank's hidden states (2**16 bytes / 4 ranks)
    assert [c.direction for c in a2a] == ["forward", "backward"]
    assert a2a[0].bytes_per_step == pytest.approx(2 * 2 * 2**16 / 4)
    assert ep.memory["activations"] == pytest.approx(one.memory["activations"])  # ep splits the batch like dp


def test_planner_tries_ep_only_for_moe_models(profile):
    dense = search(profile, PlanTarget(gpus=4, seq=32, global_batch=8, dtype="fp32"), H100, supported=refusal)
    shapes = [c.plan for c in [dense.best] + dense.alternatives]
    assert all(p.ep == 1 for p in shapes) and not any("ep=" in r for r in dense.rejected)
    moe = search(_moe_profile(), PlanTarget(gpus=4, seq=32, global_batch=8, dtype="fp32"), H100, supported=refusal)
    tried = [c.plan.ep for c in [moe.best] + moe.alternatives] + [
        int(e.split("ep=")[1].split()[0]) for e in moe.rejected_examples.values() if "ep=" in e]
    assert max(tried) > 1  # ep is enumerated (and proposed or refused by name) for an MoE model


def test_explanation_lists_the_best_plan_of_each_family(profile):
    from usc.compiler.planner import FAMILIES, family

    result = search(profile, PlanTarget(gpus=4, seq=32, global_batch=8, dtype="fp32"), H100, supported=refusal)
    text = str(result)
    assert "best of each family" in text
    tests = dict(FAMILIES)
    for name, best in result.families.items():
        assert not isinstance(best, str), (name, best)  # the tiny model fits in every family
        assert tests[name](best.plan) and family(best.plan) == name
        assert f"{name:<9} {best.plan.text()}" in text
    assert {"dp+ZeRO", "dp+tp", "dp+pp", "dp+tp+pp", "+cp"} <= set(result.families)
    assert min(c.step for c in result.families.values()) == result.best.step


def test_a_family_that_does_not_fit_says_how_close_it_came(profile):
    small = replace(H100, name="small", hbm_bytes=1_500_000)
    result = search(profile, PlanTarget(gpus=2, seq=32, global_batch=8, dtype="fp32"), small, supported=refusal)
    misses = {name: why for name, why in result.families.items() if isinstance(why, str)}
    assert misses and all(why.startswith("none fits; closest ") and "GiB per rank" in why for why in misses.values())


def test_a_choice_resting_on_an_unchecked_term_is_flagged_with_the_checked_alternative(profile):
    from usc.compiler.planner import unchecked_terms

    # cp=2: its ring's overlap with attention, a term no published run checks
    target = PlanTarget(gpus=4, seq=32, global_batch=8, dtype="fp32", gpus_per_node=2, fixed=(("cp", 2),))
    result = search(profile, target, H100, supported=refusal)
    assert unchecked_terms(result.best.plan) and "the cp ring's overlap" in str(result)
    free = search(profile, replace(target, fixed=()), H100, supported=refusal)
    if unchecked_terms(free.best.plan):
        assert free.best_checked is not None and not unchecked_terms(free.best_checked.plan)
        assert f"best plan relying on none: {free.best_checked.plan.text()}" in str(free)
    assert not unchecked_terms(PlanPoint(8, 32, dp=2, tp=2, gpus_per_node=8))


def test_collective_bandwidth_is_checked_to_32_nodes_with_a_measured_table_and_16_without():
    from usc.compiler.planner import unchecked_terms

    assert H100.measured_nodes == 64 and not replace(H100, all_reduce_busbw_by_nodes=(), all_gather_busbw_by_nodes=(),
                                                     reduce_scatter_busbw_by_nodes=()).measured_nodes
    at = lambda nodes: PlanPoint(8 * nodes, 32, dp=8 * nodes, gpus_per_node=8)  # noqa: E731
    flagged = lambda nodes, measured: any("beyond" in t for t in unchecked_terms(at(nodes), measured))  # noqa: E731
    assert not flagged(32, 64) and flagged(33, 64) and flagged(64, 64)
    assert not flagged(16, 0) and flagged(17, 0)
    assert not flagged(8, 8) and flagged(9, 8)  # a table measured to 8 nodes: checked to 8


def test_json_of_the_search_has_the_families_and_the_unchecked_terms(profile):
    from types import SimpleNamespace

    from usc.compiler.planner import unchecked_terms
    from usc.compiler.report_cost import cost_dict

    result = search(profile, PlanTarget(gpus=4, seq=32, global_batch=8, dtype="fp32", gpus_per_node=2),
                    H100, supported=refusal)
    planner = cost_dict(SimpleNamespace(cost=None, plan_search=result))["planner"]
    assert set(planner["families"]) == set(result.families)
    assert planner["families"]["dp+ZeRO"]["plan"] == result.families["dp+ZeRO"].plan.text()
    assert planner["unchecked_terms"] == unchecked_terms(result.best.plan, H100.measured_nodes)


def test_plan_point_with_is_replace():
    point = PlanPoint(96, 40, dp=3, tp=2, pp=5, mb=7, order=("pp", "dp", "tp", "cp", "ep"))
    changed = point.with_(zero=2, recompute="selective", mb=5)
    assert changed == replace(point, zero=2, recompute="selective", mb=5)
    assert hash(changed) == hash(replace(point, zero=2, recompute="selective", mb=5))
    assert point.mb == 7 and point.zero == 0  # the original is untouched
    with pytest.raises(TypeError, match="no field 'zeros'"):
        point.with_(zeros=1)


def test_usc_plan_leaves_the_collector_as_it_found_it():
    import gc

    from usc.planning import collector_paused
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("a failed search")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()  # the caller had it off: it stays off
    finally:
        gc.enable()


def test_more_microbatches_are_tried_while_they_may_allow_a_lighter_recompute():
    """Llama-3-8B on 8 H100s (dp=8 zero=3 held): full recompute first fits at 4 microbatches
    (15.62 s predicted), 8 are slower (16.63 s), and selective recompute fits only at 16 -- and is
    faster (14.98 s). The walk over microbatch counts must not stop at the first count that does not
    improve while a lighter recompute may fit at more; its best is the best of every count and mode."""
    from usc.compiler.cost_model import peak_memory
    from usc.compiler.planner import MEMORY_HEADROOM
    from usc.testing.models import LLAMA3_8B

    with torch.device("meta"):
        model = TinyLlama(LLAMA3_8B)
    tokens = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    big = profile_model(model, (tokens, tokens))
    target = PlanTarget(gpus=8, seq=4096, global_batch=256, dtype="bf16", fixed=(("dp", 8), ("zero", 3)))
    best = search(big, target, H100, supported=refusal).best
    every = [best.plan.with_(mb=mb, recompute=r) for mb in (1, 2, 4, 8, 16, 32) for r in ("none", "selective", "full")]
    fits = [p for p in every if refusal(p) is None
            and sum(peak_memory(big, p).values()) <= H100.hbm_bytes * MEMORY_HEADROOM]
    fastest = min(fits, key=lambda p: estimate(big, p, H100).time["step"])
    assert (best.plan.mb, best.plan.recompute) == (fastest.mb, fastest.recompute)
    assert best.plan.recompute == "selective"


def test_a_model_on_the_meta_device_profiles_as_on_the_cpu():
    """The meta device's attention is plain matmuls (its output stored [B, H, S, D]); the CPU
    kernel's is stored [B, S, H, D]. The profile's cp probe runs ring attention either way and must
    count the same activations: a ring output laid out unlike the model's next reshape expects
    costs a copy per layer the real run does not make."""
    config = LlamaConfig(layers=4)
    built = {}
    for device in ("meta", "cpu"):
        torch.manual_seed(0)
        with torch.device(device):
            model = TinyLlama(config)
        tokens = torch.zeros(8, 32, dtype=torch.long, device=device)
        built[device] = [(u.name, u.acts, u.held) for u in profile_model(model, (tokens, tokens)).units]
    assert built["meta"] == built["cpu"]


def test_peak_memory_is_the_fullest_stage_of_all():
    """peak_memory passes over a middle stage that repeats the middle stage before it (it can hold no
    more: as many or fewer microbatches in flight, the same transfer buffers); its answer must be
    what every stage's own count gives, for every schedule, recompute mode, ZeRO stage and an
    uneven split (13 blocks on 3-6 stages)."""
    from usc.compiler.cost_model import _repeats_previous, merged_stages, p2p_buffers, peak_memory, stage_memory

    with torch.device("meta"):
        model = TinyLlama(LlamaConfig(layers=13, hidden=72, heads=6, kv_heads=2, mlp=120))
    tokens = torch.zeros(6, 40, dtype=torch.long, device="meta")
    profile = profile_model(model, (tokens, tokens))
    skipped = 0
    for pp in (3, 4, 6):
        stages = merged_stages(profile, pp)
        skipped += sum(r for k, r in enumerate(_repeats_previous(profile, stages)) if 1 < k < pp - 1)
        for schedule, v in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zb", 1)):
            for recompute in ("none", "selective", "full"):
                for zero in (0, 1, 3):
                    plan = PlanPoint(24, 40, dp=2, tp=2, pp=pp, mb=pp * 2, zero=zero, schedule=schedule, v=v,
                                     recompute=recompute, sp=True, dtype="bf16")
                    every = [stage_memory(profile, plan, [u], k, p2p)
                             for k, (u, p2p) in enumerate(zip(stages, p2p_buffers(profile, plan, stages)))]
                    fullest = max(every, key=lambda m: sum(m.values()))  # the first of equals, as peak_memory
                    assert peak_memory(profile, plan) == fullest, (plan.text(), pp)
    assert skipped >= 2  # the shortcut ran


def test_the_hosts_launch_time_shows_only_where_the_device_runs_the_microbatch_sooner(profile):
    """``unit_overhead`` is the host's time to issue one unit's kernels per microbatch. Where the host
    queues kernels ahead of the device (``host_launch="async"``, GPUs) a microbatch takes the longer of
    the two and the device's idle share is the step's ``host`` term; where the host runs the kernels
    itself (``"sync"``, CPU ranks) all of it adds to the compute."""
    point = PlanPoint(8, 32, mb=2)  # one rank: no collective inside a microbatch
    units = len(profile.units)  # one stage holds every unit
    device = estimate(profile, point, replace(H100, unit_overhead=0.0)).time
    assert device["host"] == 0 and device["compute"] > 0
    per_microbatch = device["compute"] / point.mb

    hidden = estimate(profile, point, replace(H100, unit_overhead=0.5 * per_microbatch / units)).time
    assert hidden == pytest.approx(device, rel=1e-12)  # the device is the slower: nothing shows

    slow = 10 * per_microbatch / units  # the host takes ten times the device's time
    waits = estimate(profile, point, replace(H100, unit_overhead=slow)).time
    assert waits["compute"] == pytest.approx(device["compute"], rel=1e-12)
    assert waits["host"] == pytest.approx(point.mb * (units * slow - per_microbatch), rel=1e-9)
    assert waits["step"] == pytest.approx(device["step"] + waits["host"], rel=1e-9)

    adds = estimate(profile, point, replace(H100, unit_overhead=slow, host_launch="sync")).time
    assert adds["host"] == 0
    assert adds["compute"] == pytest.approx(device["compute"] + point.mb * units * slow, rel=1e-9)


def test_each_matrix_product_call_costs_a_fixed_time_beside_its_flops(profile):
    """With ``matmul_half_work`` a call of W multiply-adds runs at eff * W / (W + half), the same as
    2 * half FLOPs more per call at the sustained rate. The profile counts each unit's calls (a Llama
    block: q, k, v, o, gate, up, down; the head one), forward and backward (twice the calls) pay it
    per microbatch, and tp shrinks each call, not their number."""
    calls = {u.name: u.matmul_calls for u in profile.units}
    assert [calls[f"layers.{i}"] for i in range(CONFIG.layers)] == [7] * CONFIG.layers and calls["lm_head"] == 1
    assert calls["embed_tokens"] == 0 and calls["norm"] == 0
    half = 5e8
    flat = replace(H100, unit_overhead=0.0, matmul_half_work=0.0, matmul_half_rows=1e-9)  # the sustained rate
    per_call = replace(flat, matmul_half_work=half)
    rate = H100.peak_bf16_flops * H100.matmul_efficiency
    for point in (PlanPoint(8, 32, mb=2, dtype="bf16"), PlanPoint(8, 32, tp=2, mb=2, sp=True, dtype="bf16")):
        added = estimate(profile, point, per_call).time["compute"] - estimate(profile, point, flat).time["compute"]
        assert added == pytest.approx(point.mb * 3 * 2 * half * sum(calls.values()) / rate, rel=1e-6)


def test_within_a_tie_the_simplest_plan_is_chosen(profile):
    """Plans whose predicted steps lie within ``TIE`` of the fastest are one tie for the cost model: the
    simplest leads (fewest kinds of parallelism, then sizes, microbatches, recompute, ZeRO). On the h100
    profile the tiny model's every plan waits on the host about alike, and a faster-by-a-hair mesh of
    tp and pp must not be what a user is handed; a plan faster by more than the tie still wins."""
    target = PlanTarget(gpus=4, seq=32, global_batch=8, dtype="bf16")
    result = search(profile, target, H100, supported=refusal)
    faster = [c for c in result.alternatives if c.step < result.best.step]
    assert faster, "no tie: the test would not see the rule"
    assert result.best.plan.tp == result.best.plan.pp == result.best.plan.cp == 1
    for c in faster:
        assert c.step >= result.best.step / (1 + TIE)
        assert simplicity(result.best.plan) < simplicity(c.plan)
        why = result.why_lost(c)  # a faster cp plan also rests on a term nothing measured: that reason leads
        assert "which is the simpler plan" in why or "which no measurement has checked" in why
    # with the host's time gone nothing ties within half a percent of the choice from below
    device_bound = search(profile, target, replace(H100, unit_overhead=0.0), supported=refusal)
    fastest = min([device_bound.best] + device_bound.alternatives, key=lambda c: c.step)
    assert device_bound.best.step <= fastest.step * (1 + TIE)


def test_an_unchecked_term_does_not_decide_a_ranking_within_the_models_error():
    """A plan resting on a term no measurement has checked (here the cp ring's overlap) leads only when
    it is predicted more than UNCHECKED_MARGIN faster than the fastest plan resting on fewer such
    terms; within the margin the checked plan is chosen and the faster one says why it lost."""
    from types import SimpleNamespace

    from usc.compiler.planner import UNCHECKED_MARGIN, Candidate, PlanSearch, _lead, unchecked_terms

    def candidate(step, **sizes):
        return Candidate(PlanPoint(64, 4096, gpus_per_node=8, **sizes), SimpleNamespace(time={"step": step}))

    checked, ring = candidate(1.03, dp=8), candidate(1.0, dp=4, cp=2)
    assert unchecked_terms(ring.plan) and not unchecked_terms(checked.plan) and UNCHECKED_MARGIN == 0.05
    assert _lead([ring, checked], 0) is checked
    far = candidate(1.06, dp=8)  # the ring plan is 6% faster: it leads, flagged
    assert _lead([ring, far], 0) is ring
    result = PlanSearch(PlanTarget(gpus=8, seq=4096, global_batch=64), "h100", checked, [ring])
    assert result.why_lost(ring).startswith("-2.9% step time, within 5% of the choice but resting on the cp ring")


def test_a_moe_block_usc_recognises_is_planned_with_its_experts_counted():
    """usc.compile traces a mixture-of-experts block it recognises (here a router and a list of SwiGLU
    experts chosen by boolean masks) as one ``usc::moe`` node; the planner's profile now traces it the
    same way (usc.plan refused the model with a data-dependent-shape error) and counts each (token,
    chosen expert) pair's products and the experts' calls. The expected FLOPs are counted here from
    the config: q, k, v, o and the router on every token, three products per chosen expert."""
    from usc.model_call import trainable
    from usc.testing.models import MoEConfig, TinyMixtral

    cfg = MoEConfig()
    torch.manual_seed(0)
    chosen = usc.plan(TinyMixtral(cfg), "gpus=4 ep=2", example_inputs=token_batch(cfg.vocab, 8, 16))
    assert chosen.size("ep") == 2 and chosen.world_size == 4
    model = trainable(TinyMixtral(cfg), None)
    profile = profile_model(model, tuple(model.flatten(token_batch(cfg.vocab, 4, 16))))
    tokens, head_dim = 4 * 16, cfg.hidden // cfg.heads
    attention = 2 * tokens * cfg.hidden * head_dim * (2 * cfg.heads + 2 * cfg.kv_heads)
    router = 2 * tokens * cfg.hidden * cfg.experts
    experts = 2 * tokens * cfg.top_k * 3 * cfg.hidden * cfg.mlp
    layer = next(u for u in profile.units if u.name == "layers.0")
    assert layer.flops_matmul == attention + router + experts
    assert layer.matmul_calls == 4 + 1 + 3 * cfg.experts and layer.moe_layers == 1


def test_an_ep_rank_pays_the_fixed_time_of_its_own_experts_calls_only():
    """usc's expert node loops over the experts a rank holds: under ep=2 a rank runs half of them, so
    half of the experts' product calls (each a fixed device time beside its FLOPs, ~22 us on the
    h100 profile; 384 a layer for 128 experts); the attention's and the router's calls stay whole.
    The per-call time added is counted here from the config: q, k, v, o and the router, and three
    products per expert the rank holds."""
    from usc.model_call import trainable
    from usc.passes.cost_profile import profile_model
    from usc.testing.models import MoEConfig, TinyMixtral

    cfg = MoEConfig()
    torch.manual_seed(0)
    model = trainable(TinyMixtral(cfg), None)
    profile = profile_model(model, tuple(model.flatten(token_batch(cfg.vocab, 4, 16))))
    layers = [u for u in profile.units if u.moe_layers]
    assert len(layers) == cfg.layers and all(u.expert_calls == 3 * cfg.experts for u in layers)
    others = cfg.layers * (4 + 1) + 1  # q, k, v, o and the router per layer; the head
    assert sum(u.matmul_calls for u in profile.units) == others + cfg.layers * 3 * cfg.experts
    half = 5e8
    flat = replace(H100, unit_overhead=0.0, matmul_half_work=0.0, matmul_half_rows=1e-9)
    per_call = replace(flat, matmul_half_work=half)
    rate = H100.peak_bf16_flops * H100.matmul_efficiency
    for ep in (1, 2):
        point = PlanPoint(8, 16, dp=1, ep=ep, mb=2, dtype="bf16")
        added = estimate(profile, point, per_call).time["compute"] - estimate(profile, point, flat).time["compute"]
        calls = others + cfg.layers * 3 * cfg.experts / ep
        assert added == pytest.approx(point.mb * 3 * 2 * half * calls / rate, rel=1e-6), ep


def test_a_written_plans_ep_is_carved_from_its_dp_in_the_cost_model_too():
    """usc.compile carves the ep ranks from dp (``dp=4 ep=2`` runs on 4 ranks); the cost model's point
    counts dp per expert replica (2 here) and ep beside it. Reading a plan and writing a point back
    keep the plan's text and its world size (the planner once wrote ``dp=2 ep=2`` for 4 GPUs: 2 ranks)."""
    from usc.planning import point_of

    plan = usc.parse_plan("dp=4 ep=2 tp=2")
    point = point_of(plan, global_batch=8, seq=32)
    assert (point.dp, point.ep, point.tp, point.world) == (2, 2, 2, plan.world_size) == (2, 2, 2, 8)
    assert usc.parse_plan(point.text()) == plan
