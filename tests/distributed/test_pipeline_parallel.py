"""Pipeline parallelism: stages cut from the traced graph, run by schedule, equal to one device."""

from dataclasses import dataclass

import pytest
import torch

import usc
from gloo_cases import MODELS, optimizer_for
from usc.testing import assert_equivalent
from usc.testing.models import (
    GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, seeded, shifted_batch, token_batch)

SCHEDULES = ["schedule=gpipe", "schedule=1f1b", "schedule=interleaved v=2", "schedule=zb"]


def every_schedule(pp: int, extra: str = "") -> list[str]:
    """Each executed schedule with mb in {pp, 2*pp}."""
    return [f"{extra}pp={pp} mb={mb} {schedule}" for schedule in SCHEDULES for mb in (pp, 2 * pp)]


FLOAT32_PLANS = [*every_schedule(2), "dp=2 pp=2 zero=1 mb=2", "dp=2 pp=2 zero=2 mb=2"]


@pytest.mark.parametrize("plan", FLOAT32_PLANS)
@pytest.mark.parametrize("model", sorted(MODELS))
def test_pipeline_matches_one_device(model, plan):
    factory, batch = MODELS[model]
    result = assert_equivalent(factory, plan, [batch(seed) for seed in range(3)], optimizer=optimizer_for(model))
    assert result.max_param_diff <= 1e-5


# 6 layers: embedding, 6 blocks, final norm and lm head are 9 pieces, enough for pp=4 v=2's 8 stages.
DEEP = {
    "llama": (lambda: TinyLlama(LlamaConfig(layers=6)).double(), lambda s: token_batch(128, 8, 8, seed=s)),
    "gpt2": (lambda: TinyGPT2(GPT2Config(layers=6)).double(), lambda s: shifted_batch(128, 8, 8, seed=s)),
}
FLOAT64_PLANS = [*every_schedule(4), "pp=2 tp=2 mb=2", "dp=2 pp=2 tp=2 mb=2 schedule=gpipe", "cp=2 pp=2 mb=2",
                 "dp=2 pp=2 mb=2 schedule=zb", "tp=2 pp=2 mb=4 schedule=zb",
                 "dp=2 pp=2 mb=4 schedule=interleaved v=2", "tp=2 pp=2 mb=2 schedule=interleaved v=2",
                 "pp=2 mb=4 schedule=interleaved v=3"]


@pytest.mark.parametrize("plan", FLOAT64_PLANS)
@pytest.mark.parametrize("model", sorted(DEEP))
def test_pipeline_is_exact_in_float64(model, plan):
    """Float64, where float32 AdamW rounding would blur the 1e-5 bound on deeper models. GPT-2's tied
    embedding and lm head land on the first and last stage: their gradients are summed."""
    factory, batch = DEEP[model]
    result = assert_equivalent(factory, plan, [batch(s) for s in range(3)], rtol=1e-12, atol=1e-12,
                               param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_stages_are_balanced_and_contiguous():
    sim = usc.simulate(TinyLlama(LlamaConfig(layers=4)), "pp=2 mb=2", example_inputs=token_batch(128, 4, 16))
    modules = []
    for name, stage in sim.program.gm.named_children():
        paths = {n.meta["usc"].module for n in stage.graph.nodes if n.op == "call_function" and "usc" in n.meta}
        modules.append({p.split(".")[1] for p in paths if p.startswith("layers.")})
    assert modules == [{"0", "1"}, {"2", "3"}]


def test_lint_lists_the_stage_boundary_transfers():
    report = usc.lint(TinyLlama(), "pp=2 mb=4", example_inputs=token_batch(128, 4, 16))
    transfers = [c for c in report.collectives if c.axis == "pp" and c.kind == "send/recv"]
    hidden = [c for c in transfers if c.shape == (1, 16, 64)]
    assert {c.direction for c in hidden} == {"forward", "backward"}
    assert all(c.calls_per_step == 4 and c.module == "stage 0 -> stage 1" for c in transfers)


def test_unexecutable_schedules_are_refused_by_name():
    batch = token_batch(128, 4, 16)
    with pytest.raises(usc.PlanError, match="dualpipe"):
        usc.lint(TinyLlama(), "pp=2 mb=2 schedule=dualpipe", example_inputs=batch)
    with pytest.raises(usc.PlanError, match="need schedule=interleaved"):
        usc.lint(TinyLlama(), "pp=2 v=2 mb=2 schedule=zb", example_inputs=batch)
    with pytest.raises(usc.PlanError, match="multiple of pp=2, got mb=1"):
        usc.lint(TinyLlama(), "pp=2 v=2 schedule=interleaved", example_inputs=batch)
    with pytest.raises(usc.PlanError, match="need pp>1"):
        usc.lint(TinyLlama(), "schedule=gpipe", example_inputs=batch)
    # embedding, 2 blocks, final norm, lm head: 5 pieces to cut between
    with pytest.raises(usc.PlanError, match="pp=8 needs at least 8 layers"):
        usc.lint(TinyLlama(), "pp=8 mb=8", example_inputs=token_batch(128, 8, 16))
    with pytest.raises(usc.PlanError, match=r"pp\*v=6 needs at least 6 layers") as info:
        usc.lint(TinyLlama(), "pp=2 v=3 mb=2 schedule=interleaved", example_inputs=batch)
    assert info.value.column == 6  # points at v=3


class SkipNet(torch.nn.Module):
    """Every block adds the embedding back (a long skip): stage 0 sends it to every later stage."""

    def __init__(self, vocab: int = 64, hidden: int = 16, layers: int = 6):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, ids, labels):
        x0 = self.embed(ids)
        x = x0
        for layer in self.layers:
            x = torch.tanh(layer(x)) + x0
        return torch.nn.functional.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def test_messages_follow_the_senders_order_when_tags_are_ignored(monkeypatch):
    """NCCL matches point-to-point messages by post order only. With every tag dropped, interleaved
    v=2 (two stage pairs share each rank pair, and stage 0 feeds stage 3 directly) still matches
    one device: receivers take each peer's messages in its posting order."""
    from usc.runtime.comm import ThreadComm

    send, recv = ThreadComm._send, ThreadComm._recv
    monkeypatch.setattr(ThreadComm, "_send", lambda self, t, peer, tag: send(self, t, peer, 0))
    monkeypatch.setattr(ThreadComm, "_recv", lambda self, like, peer, tag: recv(self, like, peer, 0))
    plan = "pp=2 mb=4 schedule=interleaved v=2 split=layers.1|layers.3|layers.5"
    stages = usc.lint(SkipNet().double(), plan, example_inputs=token_batch(64, 8, 8)).stages
    assert {t.to_stage for t in stages[0].sends} == {1, 2, 3}
    result = assert_equivalent(lambda: SkipNet().double(), plan, [token_batch(64, 8, 8, seed=s) for s in range(2)],
                               rtol=1e-12, atol=1e-12, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_report_lists_each_stage():
    """8 layers on pp=4: stage FLOPs within 15% of each other, every layer in exactly one stage, in
    order; parameter bytes add up; only the hidden state crosses each cut, its gradient coming back."""
    model = TinyLlama(LlamaConfig(layers=8))
    report = usc.lint(model, "pp=4 mb=8", example_inputs=token_batch(128, 8, 64))
    stages = report.stages
    assert [s.rank for s in stages] == [0, 1, 2, 3]
    flops = [s.flops for s in stages]
    assert max(flops) / min(flops) <= 1.15
    modules = [m for s in stages for m in s.modules]
    assert modules == ["embed_tokens", *[f"layers.{i}" for i in range(8)], "norm", "lm_head"]
    assert sum(s.param_bytes for s in stages) == sum(p.numel() * 4 for p in model.parameters())
    for s in stages[:-1]:  # only the hidden state crosses: each stage computes its own RoPE tables
        assert [(t.to_stage, t.shape, t.bytes, t.grad) for t in s.sends] == [(s.index + 1, (1, 64, 64), 64 * 64 * 4,
                                                                               True)]
    assert not stages[-1].sends
    text = str(report)
    assert "stage 3 on pp rank 3:" in text and "layers.6, layers.7, norm, lm_head" in text
    assert len(report.to_dict()["pipeline_stages"]) == 4


@pytest.mark.parametrize("plan", ["cp=2 pp=2 mb=2", "cp=2 cp_mode=zigzag pp=2 mb=2"])
def test_sharded_rope_tables_are_recomputed_not_sent(plan):
    """cp takes this rank's piece of the RoPE tables (a LocalShard: no communication in forward); each
    stage makes its piece again, so only the hidden state crosses the cut."""
    report = usc.lint(TinyLlama(), plan, example_inputs=token_batch(128, 4, 16))
    assert [(t.to_stage, t.grad) for t in report.stages[0].sends] == [(1, True)]


def test_interleaved_stages_loop_over_the_ranks():
    report = usc.lint(TinyLlama(LlamaConfig(layers=6)), "pp=2 v=2 mb=2 schedule=interleaved",
                      example_inputs=token_batch(128, 4, 16))
    assert [s.rank for s in report.stages] == [0, 1, 0, 1]
    assert [m for s in report.stages for m in s.modules][1:7] == [f"layers.{i}" for i in range(6)]


def test_manual_split_points():
    """split=a|b starts stage k+1 at the k-th named layer; the run still equals one device."""
    factory, batch = DEEP["gpt2"]
    plan = "pp=3 mb=4 split=h.1|h.5"
    report = usc.lint(factory(), plan, example_inputs=batch(0))
    assert [s.modules[0] for s in report.stages[1:]] == ["h.1", "h.5"]
    assert report.stages[0].modules[-1] == "h.0" and "lm_head" in report.stages[2].modules
    result = assert_equivalent(factory, plan, [batch(s) for s in range(2)],
                               rtol=1e-12, atol=1e-12, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize(("plan", "message"), [
    ("pp=2 split=layers.9", "'layers.9' matches no layer of the model .* did you mean 'layers.3'"),
    ("pp=2 split=layers.1.mlp", "'layers.1.mlp' is inside layer 'layers.1'"),
    ("pp=3 split=layers.3|layers.1", "in model order"),
    ("pp=3 split=layers.1", "split names 1 cut point\\(s\\) but pp=3 has 3 stages"),
    ("pp=2 v=2 mb=2 schedule=interleaved split=layers.1", "but pp=2 v=2 has 4 stages"),
    ("split=layers.1", "needs pp>1"),
])
def test_bad_split_points_are_plan_errors(plan, message):
    with pytest.raises(usc.PlanError, match=message) as info:
        usc.lint(TinyLlama(LlamaConfig(layers=4)), plan, example_inputs=token_batch(128, 4, 16))
    assert info.value.column == plan.index("split") + 1


def test_each_pipeline_rank_holds_only_its_stages_parameters():
    """Untied Llama: the pp ranks' parameters, gradients and AdamW state partition the model's."""
    model = TinyLlama(LlamaConfig(layers=4))
    total = sum(p.numel() * 4 for p in model.parameters())
    sim = usc.simulate(model, "pp=2 mb=2", example_inputs=token_batch(128, 4, 16))
    sim.step(*token_batch(128, 4, 16))
    held = [rank.peak_state_bytes for rank in sim.ranks]
    assert sum(h["params"] for h in held) == total and all(h["params"] < 0.75 * total for h in held)
    assert sum(h["grads"] for h in held) == total
    assert sum(rank.memory_bytes()["optimizer"] for rank in sim.ranks) == 2 * total  # exp_avg, exp_avg_sq
    predicted = sim.report.memory[0]  # the report predicts pp rank 0's bytes
    assert (predicted["params"], predicted["grads"]) == (held[0]["params"], held[0]["grads"])
    assert predicted["optimizer"] == sim.ranks[0].memory_bytes()["optimizer"]
    names = [set(rank.local_state()) for rank in sim.ranks]
    params = {name for name, _ in model.named_parameters()}
    assert not names[0] & names[1] & params  # buffers (RoPE's inv_freq) live on every stage that uses them
    assert "embed_tokens.weight" in names[0] and "lm_head.weight" in names[1]


def test_a_tied_weight_is_held_once_per_rank_that_reads_it():
    """GPT-2's embedding is its lm head: one parameter under two names. Export lifts it under both and
    the graph reads one; a rank holds it once (dp=2: exactly the model's parameters), and under pp
    the first and the last rank each hold it, the others nothing of it."""
    model = TinyGPT2(GPT2Config(layers=4))
    unique = sum(p.numel() * 4 for p in model.parameters())  # torch counts the tied weight once
    tied = model.wte.weight.numel() * 4
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(model, "dp=2", example_inputs=batch)
    assert [s.aliases for s in sim.program.state if "wte.weight" in s.aliases] == [("wte.weight", "lm_head.weight")]
    assert [rank.memory_bytes()["params"] for rank in sim.ranks] == [unique, unique]
    sim = usc.simulate(TinyGPT2(GPT2Config(layers=4)), "pp=2 mb=2", example_inputs=batch)
    sim.step(*batch)
    assert sum(rank.peak_state_bytes["params"] for rank in sim.ranks) == unique + tied
    assert sum(rank.peak_state_bytes["grads"] for rank in sim.ranks) == unique + tied


@pytest.mark.parametrize("plan", ["pp=2 mb=4 schedule=interleaved v=2", "pp=4 mb=8 schedule=zb"])
def test_evaluation_runs_the_forwards_only(plan):
    """Calling the compiled model runs every F action and no backward: messages are forward only."""
    factory, batch = DEEP["llama"]
    torch.manual_seed(0)
    expected = usc.simulate(factory(), "dp=1", example_inputs=batch(0))(*batch(0))
    torch.manual_seed(0)
    sim = usc.simulate(factory(), plan, example_inputs=batch(0))
    evaluated = _pp_messages(sim, lambda: sim(*batch(0)))
    assert evaluated.loss == pytest.approx(expected, rel=1e-12)
    assert not any(p.grad is not None for rank in sim.ranks for p in rank.params)  # no backward ran
    trained = _pp_messages(sim, lambda: sim.step(*batch(0)))
    assert trained.loss == pytest.approx(expected, rel=1e-12)  # nothing changed by evaluating
    # a training step sends each activation forward and its gradient back, same shapes: evaluation
    # sends exactly the forward half of the bytes (calls pair a send with a receive, so they do not halve)
    assert evaluated.calls > 0 and 2 * evaluated.bytes == trained.bytes


@dataclass
class _Messages:
    loss: float
    calls: int
    bytes: int


def _pp_messages(sim, call) -> _Messages:
    """The loss of ``call()`` and the point-to-point calls and bytes every pp rank issued for it."""
    comms = [mesh.comm("pp") for mesh in sim.meshes]
    for comm in comms:
        comm.stats.reset()
    loss = call()
    return _Messages(loss, sum(c.stats.calls["send/recv"] for c in comms), sum(c.stats.bytes["send/recv"] for c in comms))


# ------------------------------------------------------------------ memory check of the automatic split
EIGHT = LlamaConfig(layers=8)


def _eight_layer_lint(plan: str):
    """Lint the 8-layer model in float64, its weights from seed 0 (as assert_equivalent builds it) and
    the global RNG left as it was: the same model every call, so the trace memo (tests/conftest.py)
    traces it once for this file's lints and equivalence runs; the split reads sizes, not values."""
    return usc.lint(seeded(TinyLlama, EIGHT).double(), plan, example_inputs=token_batch(EIGHT.vocab, 8, 32))


def test_split_memory_estimate_matches_what_the_ranks_hold():
    """Per stage, the split's estimate of parameters + gradients + AdamW state equals what the pp
    rank holds after a step (within 5%), and its activations per microbatch, summed over the stages,
    are within 15% of what autograd saves for one microbatch on one device."""
    batch = token_batch(EIGHT.vocab, 8, 32)
    sim = usc.simulate(TinyLlama(EIGHT), "pp=4 mb=8", example_inputs=batch)
    sim.step(*batch)
    for stage, rank in zip(sim.report.stages, sim.ranks):
        held = sum(rank.peak_state_bytes[k] for k in ("params", "grads")) + sim.memory_bytes()[stage.rank]["optimizer"]
        assert stage.state_bytes == pytest.approx(held, rel=0.05)
    assert [s.in_flight for s in sim.report.stages] == [4, 3, 2, 1]  # 1F1B: p - s microbatches in flight
    one = token_batch(EIGHT.vocab, 1, 32)  # one microbatch
    saved = usc.simulate(TinyLlama(EIGHT), "dp=1", example_inputs=one).activation_bytes(*one)[0]
    assert sum(s.activation_bytes for s in sim.report.stages) == pytest.approx(saved, rel=0.15)


def test_split_moves_layers_off_a_stage_over_device_memory():
    """The FLOP-balanced cut puts the embedding and two layers, with 4 microbatches in flight, on
    stage 0; under memory= it cannot hold, a layer moves off it, every stage fits, and the run
    still equals one device."""
    balanced = _eight_layer_lint("pp=4 mb=8")
    limit = 0.95 * balanced.stages[0].memory_bytes
    assert all(s.memory_bytes <= limit for s in balanced.stages[1:])
    plan = f"pp=4 mb=8 memory={int(limit)}B"
    tight = _eight_layer_lint(plan)
    assert len(tight.stages[0].modules) < len(balanced.stages[0].modules)
    assert all(s.memory_bytes <= limit for s in tight.stages)
    assert any("split for memory" in w and "stage 0" in w for w in tight.warnings)
    assert not any(w.startswith("pp split") for w in balanced.warnings)
    batches = [token_batch(EIGHT.vocab, 8, 32, seed=s) for s in range(2)]
    result = assert_equivalent(lambda: TinyLlama(EIGHT).double(), plan, batches, rtol=1e-12, atol=1e-12,
                               param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_split_says_when_no_cut_fits_and_keeps_the_balanced_one():
    balanced = _eight_layer_lint("pp=4 mb=8 schedule=gpipe")
    smallest_stage = min(s.state_bytes for s in balanced.stages)
    report = _eight_layer_lint(f"pp=4 mb=8 schedule=gpipe memory={int(smallest_stage)}B")
    assert [s.modules for s in report.stages] == [s.modules for s in balanced.stages]
    note = next(w for w in report.warnings if w.startswith("pp split"))
    assert "no split of the 11 layers into 4 stages fits" in note and "schedule=1f1b" in note



@pytest.mark.parametrize("plan", ["dp=2 pp=2 mb=4 schedule=1f1b", "dp=2 pp=2 mb=4 schedule=interleaved v=2",
                                  "dp=2 pp=2 mb=4 zero=2"])
def test_dp_reduction_overlaps_the_last_backward(plan):
    """Each bucket whose gradients are final is launched from the last backward of its stage, not
    after the pipeline; GPT-2's tied embedding / lm head (summed over pp first) waits for the end.
    Float64: the overlapped reduction equals one device exactly."""
    factory, batch = DEEP["gpt2"]
    plan = f"{plan} bucket_mb=0.01"
    sim = usc.simulate(factory(), plan, example_inputs=batch(0))
    sim.step(*batch(0))
    for rank in sim.ranks:
        deferred = [b for b in rank.reducer.buckets if b.deferred]
        assert rank.overlapped_buckets == len(rank.reducer.buckets) - len(deferred) > 2
    tied = [b for rank in sim.ranks for b in rank.reducer.buckets if b.deferred]
    assert tied and all(any("wte" in n or "lm_head" in n for n in b.names()) for b in tied)
    result = assert_equivalent(factory, plan, [batch(s) for s in range(2)], rtol=1e-12, atol=1e-12,
                               param_atol=1e-10)
    assert result.max_param_diff <= 1e-10
