"""The public entry points (usc.compile / usc.simulate / usc.lint / usc.parse_plan) as a user meets them.

Every expected value comes from plain PyTorch on one device or is written by hand.
"""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from usc.testing import assert_equivalent
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, shifted_batch, token_batch

SMALL = LlamaConfig(layers=1)


def twin_models(factory):
    """Two models with the same weights: one for usc, one for the plain-PyTorch reference."""
    torch.manual_seed(0)
    model = factory()
    reference = factory()
    reference.load_state_dict(model.state_dict())
    return model, reference


def train_reference(model, batches, optimizer, loss_of=lambda model, batch: model(*batch)):
    opt = optimizer(model.parameters())
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def assert_states_close(full, reference: nn.Module, atol=1e-6):
    expected = reference.state_dict()
    assert sorted(full) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def cloned(state):
    return {k: v.detach().clone() for k, v in state.items()}


# ---------------------------------------------------------------- usc.compile on one process

def test_compile_without_example_inputs_traces_on_first_step(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    model, reference = twin_models(TinyLlama)
    step = usc.compile(model, "dp=1")
    assert step.program is None  # nothing traced yet
    batches = [token_batch(128, 4, 16, seed=s) for s in range(3)]
    losses = [step.step(*b) for b in batches]
    assert step.program is not None and step.report.mesh.world_size == 1
    expected = train_reference(reference, batches, torch.optim.AdamW)
    assert losses == pytest.approx(expected, rel=1e-6, abs=1e-7)
    assert len(set(losses)) == 3  # the steps really changed the weights
    assert_states_close(step.full_state_dict(), reference, atol=1e-6)


def test_report_before_any_step_explains_what_to_do():
    step = usc.compile(TinyLlama(SMALL), "dp=1")
    with pytest.raises(RuntimeError, match="example_inputs") as info:
        step.report  # noqa: B018
    assert "step()" in str(info.value)


def test_mesh_larger_than_this_process_compiles_and_step_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    batch = token_batch(128, 16, 16)
    step = usc.compile(TinyLlama(), "dp=16 tp=8", example_inputs=batch)
    assert step.report.mesh.world_size == 16 * 8
    with pytest.raises(RuntimeError, match="torchrun --nproc-per-node 128"):
        step.step(*batch)


# ---------------------------------------------------------------- usc.simulate

def test_call_returns_the_loss_without_updating_anything():
    model, reference = twin_models(lambda: TinyLlama(SMALL))
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(model, "dp=2 tp=2", example_inputs=batch)
    before = cloned(sim.full_state_dict())
    loss = sim(*batch)
    after = sim.full_state_dict()
    assert sorted(after) == sorted(before)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert loss == pytest.approx(reference(*batch).item(), rel=1e-6)
    assert sim(*batch) == loss


class LogitsModel(nn.Module):
    """Returns logits [B, S, V]; the loss comes from a separate loss_fn."""

    def __init__(self, vocab=32, hidden=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(self.norm(x))


def flat_cross_entropy(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_loss_fn_trains_like_one_device():
    model, reference = twin_models(LogitsModel)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 32, (4, 8), generator=gen), torch.randint(0, 32, (4, 8), generator=gen))
               for _ in range(2)]
    sim = usc.simulate(model, "dp=2 tp=2", example_inputs=batches[0], loss_fn=flat_cross_entropy)
    losses = [sim.step(*b) for b in batches]
    expected = train_reference(reference, batches, torch.optim.AdamW,
                               loss_of=lambda m, b: flat_cross_entropy(m(b[0]), b[1]))
    assert losses == pytest.approx(expected, rel=1e-5, abs=1e-6)
    full = sim.full_state_dict()
    assert list(full) == list(LogitsModel().state_dict())  # the user's names, not a wrapper's
    assert_states_close(full, reference, atol=1e-5)


def test_loss_fn_collectives_point_at_user_code():
    tokens = torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(1))
    report = usc.lint(LogitsModel(), "tp=2", example_inputs=(tokens, tokens), loss_fn=flat_cross_entropy)
    loss = [c for c in report.collectives if c.module == "<root>"]
    assert loss and all(c.source.startswith("test_public_api.py:") for c in loss)


def test_optimizer_factory_is_used():
    sgd = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    model, reference = twin_models(lambda: TinyLlama(SMALL))
    batches = [token_batch(128, 4, 16, seed=s) for s in range(3)]
    sim = usc.simulate(model, "tp=2", example_inputs=batches[0], optimizer=sgd)
    losses = [sim.step(*b) for b in batches]
    # AdamW (the default) would give other losses from step 2 on: the factory must be the one used.
    assert losses == pytest.approx(train_reference(reference, batches, sgd), rel=1e-5, abs=1e-6)
    assert_states_close(sim.full_state_dict(), reference, atol=1e-5)


def test_tied_weights_appear_under_both_names_and_stay_tied():
    model, reference = twin_models(lambda: TinyGPT2(GPT2Config(layers=1)))
    batch = shifted_batch(128, 4, 16)
    sim = usc.simulate(model, "tp=2", example_inputs=batch)
    full = sim.full_state_dict()
    assert "wte.weight" in full and "lm_head.weight" in full
    assert torch.equal(full["wte.weight"], full["lm_head.weight"])
    start = full["wte.weight"].clone()
    sim.step(*batch)
    full = sim.full_state_dict()
    assert torch.equal(full["wte.weight"], full["lm_head.weight"])
    train_reference(reference, [batch], torch.optim.AdamW)
    assert not torch.equal(full["wte.weight"], start)
    torch.testing.assert_close(full["wte.weight"], reference.wte.weight.detach(), rtol=0, atol=1e-5)


def test_step_with_trace_writes_chrome_trace_for_every_rank(tmp_path):
    batch = token_batch(128, 4, 16)
    sim = usc.simulate(TinyLlama(SMALL), "dp=2 tp=2", example_inputs=batch)
    assert sim.report.exposed_comm_seconds is None
    path = tmp_path / "step.json"
    sim.step(*batch, trace=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert isinstance(events, list) and events
    assert {e["pid"] for e in events} == {0, 1, 2, 3}
    exposed = sim.report.exposed_comm_seconds
    assert isinstance(exposed, float) and exposed >= 0.0


# ---------------------------------------------------------------- errors

class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: not traceable
            return x * 2
        return x


class GatedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.lin(x)).pow(2).mean()


def test_data_dependent_control_flow_is_a_trace_error_naming_the_module():
    with pytest.raises(usc.TraceError) as info:
        usc.lint(GatedModel(), "dp=1", example_inputs=(torch.randn(4, 8),))
    err = info.value
    assert type(err) is usc.TraceError and type(err).__module__.startswith("usc.")
    assert isinstance(err, usc.CompileError) and isinstance(err, ValueError)
    assert "'gate'" in str(err)
    assert "torch.where" in str(err)


class OneHotOfArgmax(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(nn.functional.one_hot(x.argmax(-1)).float()).sum()  # num_classes from the data


def test_a_trace_error_raised_inside_torch_names_the_users_line_not_usc_s():
    """The value check is torch's (one_hot's class count); the line to change is the model's."""
    with pytest.raises(usc.TraceError) as info:
        usc.lint(OneHotOfArgmax(), "dp=1", example_inputs=(torch.randn(4, 4),))
    assert "in module '<root>' (test_public_api.py:" in str(info.value)
    assert "model_call.py" not in str(info.value)


def test_trace_error_is_not_preceded_by_a_raw_graph_dump(capfd):
    with pytest.raises(usc.TraceError):
        usc.lint(GatedModel(), "dp=1", example_inputs=(torch.randn(4, 8),))
    out, err = capfd.readouterr()
    assert "def forward" not in out + err


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).pow(2).mean()


def plan_error(model, plan, batch) -> usc.PlanError:
    with pytest.raises(usc.PlanError) as info:
        usc.lint(model, plan, example_inputs=batch)
    assert isinstance(info.value, ValueError)
    return info.value


def test_tp_that_divides_nothing_names_a_module_and_points_at_tp():
    err = plan_error(TinyLlama(), "dp=1 tp=3", token_batch(128, 4, 16))
    assert (err.line, err.column) == (1, 6)
    assert "tp=3" in str(err) and "'embed_tokens'" in str(err)  # 128-row embedding, 3 does not divide it


def test_dp_that_does_not_divide_the_batch_names_dp_and_the_batch():
    err = plan_error(TinyLlama(SMALL), "tp=1\ndp=3", token_batch(128, 4, 16))
    assert (err.line, err.column) == (2, 1)
    assert "dp=3" in err.message and "[4, 16]" in err.message


def test_dp_that_does_not_divide_a_microbatch_says_dp_times_mb():
    """A batch of 6 is a multiple of dp=2, but its microbatches of 3 are not: the fix is a multiple of 4."""
    err = plan_error(TinyLlama(SMALL), "dp=2 mb=2", token_batch(128, 6, 16))
    assert "microbatch of input" in err.message and "the batch of 6 in mb=2 microbatches" in err.message
    assert "multiple of 4 (dp x mb)" in err.hint


@pytest.mark.parametrize("plan, position, name", [
    ("dp=2 pp=2 capacity_factor=1.5", (1, 11), "capacity_factor"),
    ("pp=2 schedule=zb recompute=full", (1, 18), "recompute"),
    ("pp=2 schedule=zb recompute=selective", (1, 18), "recompute"),
])
def test_unimplemented_options_are_refused_by_name(plan, position, name):
    err = plan_error(TwoLinears(), plan, (torch.randn(4, 8),))
    assert (err.line, err.column) == position
    assert name in err.message and "not implemented" in err.message


def test_rule_matching_no_module_names_the_rule_and_a_close_path():
    err = plan_error(TinyLlama(SMALL), "tp=2 nothing.*: colwise", token_batch(128, 4, 16))
    assert (err.line, err.column) == (1, 6)
    assert "nothing.*" in err.message
    typo = plan_error(TinyLlama(SMALL), "tp=2 layers.*.mlp.down_prj: rowwise", token_batch(128, 4, 16))
    assert "layers.0.mlp.down_proj" in typo.hint


GQA_ONE_KV_HEAD = LlamaConfig(heads=4, kv_heads=1, hidden=64, layers=1)


def test_gqa_with_fewer_kv_heads_than_tp_compiles_and_trains_like_one_device():
    report = usc.lint(TinyLlama(GQA_ONE_KV_HEAD), "tp=2", example_inputs=token_batch(128, 4, 16))
    styles = {c.module: c.style for c in report.tp_choices}
    assert styles["layers.0.self_attn.q_proj"] == "colwise"
    assert styles["layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["layers.0.mlp.down_proj"] == "rowwise"
    # SGD, not AdamW: AdamW turns float rounding in gradients of ~1e-8 into 1e-5 weight differences.
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)
    assert_equivalent(lambda: TinyLlama(GQA_ONE_KV_HEAD), "tp=2",
                      [token_batch(128, 4, 16, seed=s) for s in range(2)], optimizer=sgd, param_atol=1e-6)


def test_gqa_kv_heads_not_divisible_by_tp_fall_back_with_a_warning():
    report = usc.lint(TinyLlama(GQA_ONE_KV_HEAD), "tp=2", example_inputs=token_batch(128, 4, 16))
    styles = {c.module: c.style for c in report.tp_choices}
    # q stays split by heads; the single k/v head is computed whole on every rank (Megatron's answer
    # when tp exceeds the kv heads) and each rank slices the heads its queries need.
    assert styles["layers.0.self_attn.q_proj"] == "colwise" and styles["layers.0.self_attn.o_proj"] == "rowwise"
    assert styles["layers.0.self_attn.k_proj"] == "replicate" and styles["layers.0.self_attn.v_proj"] == "replicate"
    attention = [c for c in report.collectives if c.module.startswith("layers.0.self_attn")]
    # the slice's backward gathers the k and v gradients: one all-gather each, nothing in forward
    others = [(c.kind, c.direction) for c in attention if c.kind != "all-reduce"]
    assert others == [("all-gather", "backward")] * 2
    assert any("k_proj" in w for w in report.warnings)


KV_NARROWER_THAN_TP = LlamaConfig(vocab=32, hidden=8, heads=4, kv_heads=1, mlp=16, layers=1, max_seq=16)


def test_automatic_tp_keeps_a_linear_whole_when_tp_does_not_divide_its_weight():
    """k/v weights of 1 head x 2 dims cannot split 4 ways: automatic TP keeps them whole (found by
    the all-dimension property test, which raised a PlanError here) while q/o and the MLP split."""
    batch = token_batch(32, 4, 8)
    report = usc.lint(TinyLlama(KV_NARROWER_THAN_TP), "tp=4", example_inputs=batch)
    styles = {c.module: c.style for c in report.tp_choices}
    assert styles["layers.0.self_attn.k_proj"] == "replicate" and styles["layers.0.self_attn.q_proj"] == "colwise"
    assert any("k_proj" in w and "does not divide dim 0 (size 2)" in w for w in report.warnings)
    assert_equivalent(lambda: TinyLlama(KV_NARROWER_THAN_TP).double(), "tp=4", [batch] * 2,
                      rtol=1e-10, atol=1e-12, param_atol=1e-9)


def test_an_explicit_rule_on_an_indivisible_weight_is_still_a_plan_error():
    with pytest.raises(usc.PlanError, match="does not divide dim 0 .size 2. of the weight of 'layers.0.self_attn.k_proj'"):
        usc.lint(TinyLlama(KV_NARROWER_THAN_TP), "tp=4 layers.*.self_attn.k_proj: colwise",
                 example_inputs=token_batch(32, 4, 8))


def test_plan_text_reads_back_equal():
    plan = usc.parse_plan("tp=2  dp=2 # c\n layers.*.mlp.down_proj: rowwise")
    assert str(plan) == "tp=2 dp=2 layers.*.mlp.down_proj: rowwise"
    again = usc.parse_plan(str(plan))
    assert again == plan
    assert again.mesh_axes == ("tp", "dp") and again.mesh_shape == (2, 2)


def test_nan_loss_is_reported_with_step_and_rank_and_no_update_happens():
    batch = token_batch(128, 4, 16)
    model = TinyLlama(SMALL)
    sim = usc.simulate(model, "dp=2 tp=2", example_inputs=batch)
    sim.step(*batch)
    before = {k: v.clone() for k, v in sim.full_state_dict().items()}
    for rank in sim.ranks:  # poison one weight on every rank: the loss becomes NaN
        next(iter(rank.params)).data.fill_(float("nan"))
    with pytest.raises(usc.NonFiniteLoss) as info:
        sim.step(*batch)
    assert info.value.step == 2 and "step 2" in str(info.value) and "rank" in str(info.value)
    after = sim.full_state_dict()
    untouched = [k for k in before if not torch.isnan(after[k]).any()]
    assert untouched and all(torch.equal(before[k], after[k]) for k in untouched)
