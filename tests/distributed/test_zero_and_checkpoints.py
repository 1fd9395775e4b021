"""ZeRO-1/2, microbatches, bf16 and checkpoints across plans — each against one device."""

import os

import pytest
import torch

import usc
from gloo_cases import MODELS, optimizer_for
from usc.testing import assert_equivalent
from usc.testing.equivalence import assert_bf16_close, compare_states, reference_run
from usc.testing.models import LlamaConfig, TinyGPT2, TinyLlama, shifted_batch, token_batch

ZERO_PLANS = ["dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3", "dp=4 zero=1", "dp=4 zero=2", "dp=4 zero=3",
              "dp=2 tp=2 zero=2", "dp=2 tp=2 zero=3", "dp=2 zero=3 mb=2",
              "dp=2 zero=2 mb=2", "mb=2", "dp=2 mb=2"]


@pytest.mark.parametrize("plan", ZERO_PLANS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_zero_and_microbatches_match_one_device(model, plan):
    factory, batch = MODELS[model]
    result = assert_equivalent(factory, plan, [batch(seed) for seed in range(3)], optimizer=optimizer_for(model))
    assert result.max_param_diff <= 1e-5


@pytest.mark.parametrize("plan", ["dp=2 zero=1", "dp=4 zero=2", "dp=2 tp=2 zero=2", "dp=2 mb=2 zero=2",
                                  "dp=4 zero=3", "cp=2 dp=2 zero=3"])
def test_zero_is_exact_in_float64(plan):
    """No tolerance needed beyond float64 rounding: the sharded update is the full update."""
    result = assert_equivalent(lambda: TinyGPT2().double(), plan, [shifted_batch(128, 4, 16, seed=s) for s in range(3)],
                               rtol=1e-12, atol=1e-12, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("model, plan, batch, seq", [
    # the reduce-scatters of ZeRO-1 (once per step) and ZeRO-2 (every microbatch; the cp sum once, on
    # the summed slice; pipelines, an interleaved one, whose two local stages share a bucket that fills
    # across microbatches; GPT-2's tied weight, summed over pp first, in a bucket sent once), odd
    # sizes so the slices are padded
    ("gpt2", "dp=3 mb=3 zero=1", 9, 15), ("gpt2", "dp=3 mb=3 zero=2", 9, 15), ("gpt2", "dp=2 cp=2 mb=3 zero=2", 6, 14),
    ("gpt2", "dp=3 mb=3 zero=2 tp=2", 9, 15), ("llama", "dp=2 pp=2 mb=3 zero=2", 6, 15),
    ("llama", "dp=2 pp=2 v=2 mb=4 schedule=interleaved zero=2", 8, 15),
    ("gpt2", "dp=2 pp=2 mb=3 zero=2 bucket_mb=0.01", 6, 15)])
def test_zero_reduce_scatter_is_exact_in_float64(model, plan, batch, seq):
    """SGD with momentum (a gradient summed twice or scaled wrong moves the parameters at once), three
    steps: the sharded updates are the full ones up to float64 rounding."""
    make, data = (TinyGPT2, shifted_batch) if model == "gpt2" else (TinyLlama, token_batch)
    result = assert_equivalent(lambda: make().double(), plan, [data(127, batch, seq, seed=s) for s in range(3)],
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                               rtol=1e-12, atol=1e-12, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("zero, sends", [(1, 1), (2, 3)])
def test_zero_reduce_scatters_gradients_once_per_step_or_per_microbatch(zero, sends):
    """ZeRO-1 and -2 reduce-scatter the gradients over dp (no all-reduce of them): ZeRO-1 once per
    step, ZeRO-2 in each of the three microbatches' backward, per bucket; the report lists the same calls, and
    every rank ends holding only its slice of each bucket's gradient."""
    batch = token_batch(128, 12, 16)
    sim = usc.simulate(TinyLlama(), f"dp=2 mb=3 zero={zero} bucket_mb=0.01", example_inputs=batch)
    rank = sim.ranks[0]
    comm = rank.mesh.comm("dp")
    calls = dict(comm.stats.calls)
    sim.step(*batch)
    buckets = len(rank.reducer.buckets)
    assert buckets > 3  # small buckets: the count is per bucket, not one bucket's
    assert comm.stats.calls["reduce-scatter"] - calls.get("reduce-scatter", 0) == sends * buckets
    # the token count per microbatch and the returned loss: the only all-reduces over dp
    assert comm.stats.calls["all-reduce"] - calls.get("all-reduce", 0) == 3 + 1
    listed = [c for c in sim.report.collectives if c.axis == "dp" and c.kind == "reduce-scatter"]
    assert sum(c.calls_per_step for c in listed) == sends * buckets
    assert all(p.grad is None for p in rank.params)


@pytest.mark.parametrize("plan", ["dp=2 tp=2 dtype=bf16", "dp=2 zero=3 dtype=bf16"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_bf16_trains_like_float32_within_bf16_rounding(model, plan):
    """Losses and parameter updates of SGD steps within bounds from bf16's unit roundoff and the step
    count (usc.testing.equivalence.assert_bf16_close), and different from float32: it ran in bf16."""
    factory, batch = MODELS[model]
    result = assert_bf16_close(factory, plan, batch(0))
    assert result.losses != pytest.approx(result.reference_losses, rel=1e-6)


def test_bf16_keeps_float32_master_weights():
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama(), "dp=2 tp=2 dtype=bf16", example_inputs=batch)
    sim.step(*batch)
    assert all(p.dtype == torch.float32 for rank in sim.ranks for p in rank.params)


def test_memory_prediction_matches_measurement_at_dp4():
    batch = token_batch(128, 8, 16)
    for stage in range(4):
        torch.manual_seed(0)
        plan = f"dp=4 zero={stage}" if stage else "dp=4"
        sim = usc.simulate(TinyLlama(), plan, example_inputs=batch)
        sim.step(*batch)
        sim.step(*batch)  # the optimizer state exists from the first step on
        measured = sim.ranks[1].peak_state_bytes
        predicted = sim.report.memory[stage]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == pytest.approx(predicted[kind], rel=0.05), (stage, kind)
    params = sum(p.numel() * 4 for p in TinyLlama().parameters())
    assert sim.report.memory[0]["optimizer"] == 2 * params
    assert sim.report.memory[2]["grads"] == pytest.approx(params / 4, rel=0.01)
    assert sim.report.memory[3]["params"] == pytest.approx(params / 4, rel=0.01)


CHECKPOINT_PLANS = [("dp=2 tp=2", "dp=4"), ("tp=2", "dp=1"), ("dp=2 zero=2", "dp=1"), ("dp=1", "dp=2 zero=1"),
                    ("cp=2", "tp=2 sp=on"), ("dp=2 zero=3", "dp=2"), ("tp=2", "dp=2 zero=3"),
                    ("pp=2 mb=2", "dp=2"), ("dp=1", "pp=2 mb=2 schedule=zb"),
                    ("dp=2 pp=2 zero=1 mb=2", "pp=2 v=2 mb=2 schedule=interleaved")]


@pytest.mark.parametrize("plan_a, plan_b", CHECKPOINT_PLANS)
def test_checkpoint_moves_between_plans_and_training_continues_exactly(tmp_path, plan_a, plan_b):
    batches = [token_batch(128, 4, 16, seed=s) for s in range(4)]
    torch.manual_seed(0)
    reference, first, second = TinyLlama(), TinyLlama(), TinyLlama()
    first.load_state_dict(reference.state_dict())
    expected = reference_run(reference, batches, lambda p: torch.optim.AdamW(p))
    run_a = usc.simulate(first, plan_a, example_inputs=batches[0])
    losses = [run_a.step(*b) for b in batches[:2]]
    run_a.save(tmp_path / "ckpt")
    run_b = usc.simulate(second, plan_b, example_inputs=batches[0])  # different random weights
    run_b.load(tmp_path / "ckpt")
    losses += [run_b.step(*b) for b in batches[2:]]
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    worst, _ = compare_states(run_b.full_state_dict(), reference.state_dict(), atol=1e-5)
    assert worst <= 1e-5


def test_checkpoint_with_a_missing_piece_names_it(tmp_path):
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama(), "dp=2", example_inputs=batch)
    sim.step(*batch)
    sim.save(tmp_path / "ckpt")
    piece = next(p for p in sorted(os.listdir(tmp_path / "ckpt")) if p.endswith(".pt"))
    os.remove(tmp_path / "ckpt" / piece)
    with pytest.raises(usc.CheckpointError) as info:
        sim.load(tmp_path / "ckpt")
    assert piece in str(info.value)


def test_no_partial_checkpoint_is_left_under_the_name(tmp_path, monkeypatch):
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama(), "dp=2", example_inputs=batch)
    from usc.runtime import checkpoint

    def broken_write(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "write_metadata", broken_write)
    with pytest.raises(usc.CheckpointError, match="rank 0 could not"):
        sim.save(tmp_path / "ckpt")
    assert os.listdir(tmp_path) == []
    with pytest.raises(usc.CheckpointError):
        sim.load(tmp_path / "ckpt")


def test_zero_without_dp_is_refused():
    with pytest.raises(usc.PlanError, match="dp>1"):
        usc.lint(TinyLlama(), "zero=1", example_inputs=token_batch(128, 4, 16))


def test_zero3_holds_at_most_two_layers_whole():
    """Current layer + the prefetched one: never the whole model."""
    batch = token_batch(128, 8, 16)
    sim = usc.simulate(TinyLlama(LlamaConfig(layers=4)), "dp=4 zero=3", example_inputs=batch)
    sim.step(*batch)
    assert [rank.zero3.peak_live_groups for rank in sim.ranks] == [2, 2, 2, 2]
    # layer by layer: a fetch of the next layer is issued before each layer computes
    gathers = [c for c in sim.report.collectives if c.kind == "all-gather" and c.direction == "forward"]
    assert [c.module for c in gathers] == ["embed_tokens", "layers.0", "layers.1", "layers.2", "layers.3",
                                           "norm", "lm_head"]


def test_zero3_moves_each_layer_in_one_collective_per_direction():
    """A collective per parameter costs a fixed latency each: a step gathers each layer once in
    forward, at most once more in backward, and reduce-scatters its gradients once."""
    batch = token_batch(128, 8, 16)
    sim = usc.simulate(TinyLlama(LlamaConfig(layers=4)), "dp=4 zero=3", example_inputs=batch)
    groups = [c.module for c in sim.report.collectives if c.kind == "all-gather" and c.direction == "forward"]
    params = [s for s in sim.program.state if s.zero3]
    assert len(params) > 4 * len(groups) // 2  # many parameters per group, so the count means something
    comm = sim.ranks[0].mesh.comm("dp")
    sim.step(*batch)
    before = dict(comm.stats.calls)
    sim.step(*batch)
    calls = {kind: n - before.get(kind, 0) for kind, n in comm.stats.calls.items()}
    assert calls["reduce-scatter"] == len(groups)
    assert len(groups) < calls["all-gather"] <= 2 * len(groups)
    total = sum(p.numel() for p in TinyLlama(LlamaConfig(layers=4)).parameters())
    assert sum(p.numel() for p in sim.ranks[0].params) == pytest.approx(total / 4, rel=0.01)


def test_report_names_the_zero_collectives():
    batch = token_batch(128, 8, 16)
    kinds = lambda plan: {(c.kind, c.direction) for c in usc.lint(TinyLlama(), plan, example_inputs=batch).collectives  # noqa: E731
                          if c.axis == "dp" and c.source != "step()"}
    assert ("all-reduce", "backward") in kinds("dp=2") and ("all-gather", "optimizer") not in kinds("dp=2")
    assert ("all-gather", "optimizer") in kinds("dp=2 zero=1")
    assert {("reduce-scatter", "backward"), ("all-gather", "optimizer")} <= kinds("dp=2 zero=2")
    assert ("all-reduce", "backward") not in kinds("dp=2 zero=3")
    assert {("all-gather", "forward"), ("reduce-scatter", "backward"), ("all-gather", "backward")} <= kinds("dp=2 zero=3")


def test_bf16_gradient_reduction_option():
    """reduce_dtype=bf16 sums gradients in bfloat16 (half the bytes): close to, not equal to, fp32."""
    result = assert_bf16_close(TinyLlama, "dp=2 dtype=bf16 reduce_dtype=bf16", token_batch(128, 4, 16))
    assert result.losses != pytest.approx(result.reference_losses, rel=1e-6)  # it computed in bf16
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama(), "dp=2 dtype=bf16 reduce_dtype=bf16", example_inputs=batch)
    comm = sim.ranks[0].mesh.comm("dp")
    sim.step(*batch)
    params = sum(p.numel() for p in TinyLlama().parameters())
    assert comm.stats.bytes["all-reduce"] < params * 2 + 64  # bf16 buckets: 2 bytes per element


def test_zero2_sums_the_other_axes_in_the_reduce_dtype_as_zero1_does():
    """reduce_dtype=bf16: after ZeRO's dp reduce-scatter the cp sum of the slice travels in bf16
    under ZeRO-2 as under ZeRO-1 (ZeRO-2 sums its microbatches' slices in float32 and sent that
    sum over cp in float32: twice the bytes), and the two give the same gradients to bf16 rounding."""
    cfg = LlamaConfig(layers=2)
    batch = token_batch(cfg.vocab, 8, 32)
    cp_bytes, moved = {}, {}
    for zero in (1, 2):
        torch.manual_seed(0)
        model = TinyLlama(cfg)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        sim = usc.simulate(model, f"dp=2 cp=2 mb=2 zero={zero} reduce_dtype=bf16", example_inputs=batch,
                           optimizer=lambda params: torch.optim.SGD(params, lr=1.0))
        sim.step(*batch)
        cp_bytes[zero] = sim.ranks[0].mesh.comm("cp").stats.bytes["all-reduce"]
        after = sim.full_state_dict()
        moved[zero] = torch.cat([(before[k] - after[k]).reshape(-1) for k in sorted(before) if k in after])
    assert cp_bytes[2] == cp_bytes[1]
    assert moved[1].abs().max() > 0  # an SGD step at lr 1: what moved is the gradient
    assert torch.allclose(moved[2], moved[1], rtol=2 ** -6, atol=2 ** -8 * moved[1].abs().max().item())
