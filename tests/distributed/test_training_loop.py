"""The training loop a user writes: clipping, schedules, param groups, metrics and eval mode,
each against the same loop on one device (float64 and SGD, so a wrong norm cannot hide)."""

import math

import pytest
import torch

import usc
from usc.testing.hf import CausalLMLoss
from usc.testing.models import LlamaConfig, TinyDeepSeek, TinyGPT2, TinyLlama, shifted_batch, token_batch

# every plan kind; odd sizes where the plan allows (the batch is 6 sequences of 12 tokens)
CLIP_PLANS = ["dp=1", "dp=2", "dp=3", "tp=2", "tp=2 sp=on", "cp=2", "pp=2 mb=2", "dp=2 tp=2",
              "dp=2 zero=1", "dp=2 zero=2", "dp=2 zero=3", "dp=2 tp=2 zero=3", "mb=3", "dp=3 pp=2 zero=1 mb=2",
              "pp=3 mb=3"]


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _one_device(model, batches, max_norm):
    """The reference: torch's own clip_grad_norm_ on the plain model."""
    opt = _sgd(model.parameters())
    losses, norms = [], []
    for batch in batches:
        loss = model(*batch)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms


def _run_clipped(factory, plan, batches, max_norm):
    torch.manual_seed(0)
    reference, mesh_model = factory(), factory()
    mesh_model.load_state_dict(reference.state_dict())
    expected, expected_norms = _one_device(reference, batches, max_norm)
    sim = usc.simulate(mesh_model, plan, example_inputs=batches[0], optimizer=_sgd)
    losses, norms = [], []
    for batch in batches:
        losses.append(sim.step(*batch, max_grad_norm=max_norm))
        norms.append(sim.metrics.grad_norm)
    return reference, sim, (expected, expected_norms), (losses, norms)


def _llama64():
    return TinyLlama(LlamaConfig(layers=3)).double()


@pytest.mark.parametrize("plan", CLIP_PLANS)
def test_clipping_matches_one_device_in_float64(plan):
    batches = [token_batch(128, 6, 12, seed=s) for s in range(3)]
    reference, sim, (expected, expected_norms), (losses, norms) = _run_clipped(_llama64, plan, batches, 0.05)
    assert min(expected_norms) > 0.05 * 4  # the clip bites on every step
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)
    full = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-9, atol=1e-11, msg=name)


@pytest.mark.parametrize("plan", ["pp=2 mb=2", "dp=2 tp=2", "tp=2 zero=3 dp=2"])
def test_clipping_counts_a_tied_weight_once(plan):
    """GPT-2 ties wte and lm_head: under pp the two stages hold one weight; it counts once."""
    batches = [shifted_batch(128, 4, 16, seed=s) for s in range(2)]
    factory = lambda: TinyGPT2().double()  # noqa: E731
    _, _, (expected, expected_norms), (losses, norms) = _run_clipped(factory, plan, batches, 0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)


@pytest.mark.parametrize("plan", ["dp=2 ep=2", "dp=4 ep=2 tp=2"])
def test_clipping_counts_experts_once_under_ep(plan):
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    factory = lambda: TinyDeepSeek().double()  # noqa: E731
    _, _, (expected, expected_norms), (losses, norms) = _run_clipped(factory, plan, batches, 0.05)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    assert losses == pytest.approx(expected, rel=1e-10)


def test_infinite_max_norm_measures_without_clipping():
    batches = [token_batch(128, 4, 16, seed=s) for s in range(2)]
    _, sim, (expected, expected_norms), (losses, norms) = _run_clipped(_llama64, "dp=2 tp=2", batches, math.inf)
    assert norms == pytest.approx(expected_norms, rel=1e-10)
    sim.step(*batches[0])
    assert sim.metrics.grad_norm is None  # not asked: no collective spent on it


def _no_decay(name: str) -> bool:
    """Written out here, independently of usc.training.NO_DECAY."""
    return name.endswith("bias") or name.split(".")[-2].startswith("ln_") or name in ("wte.weight", "wpe.weight")


GROUP_PLANS = ["dp=1", "dp=2", "dp=2 zero=1", "dp=2 zero=2", "dp=2 tp=2 zero=3", "pp=2 mb=2", "dp=2 tp=2 zero=2"]


@pytest.mark.parametrize("plan", GROUP_PLANS)
def test_param_groups_and_schedule_match_one_device(plan):
    """AdamW with a large weight decay off for norms/biases/embeddings, warmup + cosine, clipping:
    the full recipe of an LLM run, in float64 against the same recipe by hand on one device."""
    batches = [shifted_batch(128, 4, 16, seed=s) for s in range(5)]
    schedule = usc.training.warmup_cosine(warmup=2, total=4)
    torch.manual_seed(0)
    reference, mesh_model = TinyGPT2().double(), TinyGPT2().double()
    mesh_model.load_state_dict(reference.state_dict())
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.5},
                             {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0}], lr=1e-2)
    sched = schedule(opt)
    expected, lrs = [], []
    for batch in batches:
        loss = reference(*batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        expected.append(loss.item())
    factory = usc.training.param_groups(lambda groups: torch.optim.AdamW(groups, lr=1e-2), weight_decay=0.5)
    sim = usc.simulate(mesh_model, plan, example_inputs=batches[0], optimizer=factory, lr_scheduler=schedule)
    losses, seen_lrs = [], []
    for batch in batches:
        losses.append(sim.step(*batch, max_grad_norm=0.5))
        seen_lrs.append(sim.metrics.lr)
    assert seen_lrs == pytest.approx(lrs, rel=1e-12) and len(set(lrs)) == 4  # warmup, peak, decay
    assert losses == pytest.approx(expected, rel=1e-9)
    full = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-8, atol=1e-10, msg=name)
    assert all(len(opt.param_groups) == 2 for opt in sim.optimizers)


def test_param_groups_change_the_result():
    """The groups matter: decaying everything gives other norm weights after one step, the same
    decayed weights (so the test above can fail)."""
    batches = [shifted_batch(128, 4, 16)]
    torch.manual_seed(0)
    a, b = TinyGPT2().double(), TinyGPT2().double()
    b.load_state_dict(a.state_dict())
    grouped = usc.training.param_groups(lambda g: torch.optim.AdamW(g, lr=1e-2), weight_decay=0.5)
    runs = [usc.simulate(a, "dp=2 zero=2", example_inputs=batches[0], optimizer=grouped),
            usc.simulate(b, "dp=2 zero=2", example_inputs=batches[0],
                         optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.5))]
    for batch in batches:
        for run in runs:
            run.step(*batch)
    first, second = (run.full_state_dict() for run in runs)
    assert not torch.allclose(first["ln_f.weight"], second["ln_f.weight"])
    torch.testing.assert_close(first["h.0.c_fc.weight"], second["h.0.c_fc.weight"])


def test_warmup_cosine_values():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    sched = usc.training.warmup_cosine(warmup=4, total=10, min_ratio=0.1)(opt)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    # warmup: 2 * (s + 1) / 4; then 2 * (0.1 + 0.9 * (1 + cos(pi * (s - 4) / 6)) / 2), held at 0.2
    expected = [0.5, 1.0, 1.5, 2.0] + [2 * (0.1 + 0.45 * (1 + math.cos(math.pi * k / 6))) for k in range(6)] + [0.2, 0.2]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_metrics_of_a_step():
    batch = shifted_batch(128, 4, 16)
    sim = usc.simulate(TinyGPT2(), "dp=2 zero=1", example_inputs=batch)
    loss = sim.step(*batch, max_grad_norm=1.0)
    metrics = sim.metrics
    assert metrics.step == 1 and metrics.loss == loss and metrics.lr == pytest.approx(1e-3)
    assert metrics.tokens == batch[1].numel() and metrics.seconds > 0
    assert metrics.tokens_per_s == pytest.approx(metrics.tokens / metrics.seconds)
    assert metrics.peak_bytes == max(sum(rank.peak_state_bytes.values()) for rank in sim.ranks) > 0
    assert "grad_norm" in str(metrics) and metrics.grad_norm > 0
    sim.step(*batch)
    assert sim.metrics.step == 2


class TwoLinears(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5))

    def forward(self, x, y):
        return torch.nn.functional.mse_loss(self.net(x), y)


def test_mfu_counts_the_model_flops_against_the_hardware_peak():
    """Two linears (odd sizes), batch 6: a step is 3 x 2 x 6 x (7*13 + 13*5) FLOPs; the peak is the
    hardware's at the plan's dtype times the ranks (A100 fp32: 19.5 TFLOP/s, datasheet)."""
    batch = (torch.randn(6, 7), torch.randn(6, 5))
    sim = usc.simulate(TwoLinears(), "dp=2", example_inputs=batch, hardware="a100")
    sim.step(*batch)
    metrics = sim.metrics
    assert metrics.flops == 3 * 2 * 6 * (7 * 13 + 13 * 5)
    assert metrics.peak_flops == 2 * 19.5e12
    assert metrics.mfu == pytest.approx(metrics.flops / (metrics.seconds * 2 * 19.5e12), rel=1e-12)
    assert f"mfu {metrics.mfu:.2%}" in str(metrics)


def test_mfu_of_gpt2_is_the_textbook_count():
    """GPT-2 (Kaplan et al. 2020, PaLM's MFU): 6 N T for the matmul weights (12 H^2 per layer and the
    lm head) plus 12 L S H T for causal attention counted whole; a pipeline counts every microbatch
    once, bf16 plans take the bf16 peak (H100, the default off a known GPU: 989.4 TFLOP/s)."""
    from usc.testing.models import GPT2Config

    cfg = GPT2Config(vocab=96, hidden=48, heads=3, layers=2)
    b, s = 6, 10
    batch = shifted_batch(cfg.vocab, b, s)
    sim = usc.simulate(TinyGPT2(cfg), "pp=2 mb=3 dtype=bf16", example_inputs=batch)
    sim.step(*batch)
    tokens, h = b * s, cfg.hidden
    weights = cfg.layers * 12 * h * h + h * cfg.vocab
    assert sim.metrics.flops == 6 * weights * tokens + 12 * cfg.layers * s * h * tokens
    assert sim.metrics.peak_flops == 2 * 989.4e12


def test_optimizer_is_the_one_that_steps():
    """Changing the lr of step.optimizer changes the update (the real optimizer, even under ZeRO)."""
    batch = token_batch(128, 4, 16)
    torch.manual_seed(0)
    a, b = TinyLlama(), TinyLlama()
    b.load_state_dict(a.state_dict())
    initial = a.norm.weight.detach().clone()
    runs = [usc.simulate(m, "dp=2 zero=2", example_inputs=batch, optimizer=_sgd) for m in (a, b)]
    for opt in runs[1].optimizers:
        for group in opt.param_groups:
            group["lr"] = 0.0
    for run in runs:
        run.step(*batch)
    assert torch.equal(runs[1].full_state_dict()["norm.weight"], initial)
    assert not torch.equal(runs[0].full_state_dict()["norm.weight"], initial)


def _hf_gpt2_with_dropout():
    """Hugging Face's GPT-2 with every dropout on (a model not written for usc)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                                  attn_implementation="sdpa", resid_pdrop=0.3, embd_pdrop=0.3, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    return CausalLMLoss(transformers.GPT2LMHeadModel(cfg)).double()


def _dropout_reference(batch):
    torch.manual_seed(0)
    reference, mesh_model = _hf_gpt2_with_dropout(), _hf_gpt2_with_dropout()
    mesh_model.load_state_dict(reference.state_dict())
    return reference, mesh_model


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_eval_mode_turns_dropout_off_like_torch(plan):
    batch = token_batch(32, 4, 8)
    reference, mesh_model = _dropout_reference(batch)
    with torch.no_grad():
        expected = reference.eval()(*batch).item()
    sim = usc.simulate(mesh_model, plan, example_inputs=batch)
    assert sim.training
    assert sim.eval_step(*batch) == pytest.approx(expected, rel=1e-12)
    assert sim(*batch) != pytest.approx(expected, rel=1e-6)  # training mode: dropout on, as model(x)
    assert sim.eval() is sim and not sim.training
    assert sim(*batch) == pytest.approx(expected, rel=1e-12)
    assert all(p.grad is None for rank in sim.ranks for p in rank.params)  # nothing kept for backward
    sim.train()
    assert sim.training and sim(*batch) != pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2"])
def test_the_models_own_eval_and_train_set_the_programs_mode(plan):
    """The loop people write toggles the model: model.eval() before validation, model.train() after.
    The program ran in its own mode whatever the model's (dropout on after model.eval(), no error);
    now one flag: the model's train()/eval() is the program's mode, and the program's sets the model's."""
    batch = token_batch(32, 4, 8)
    reference, mesh_model = _dropout_reference(batch)
    with torch.no_grad():
        expected = reference.eval()(*batch).item()
    sim = usc.simulate(mesh_model, plan, example_inputs=batch)
    mesh_model.eval()
    assert not sim.training and sim(*batch) == pytest.approx(expected, rel=1e-12)
    mesh_model.train()
    assert sim.training and sim(*batch) != pytest.approx(expected, rel=1e-6)
    sim.eval()
    assert not mesh_model.training and sim(*batch) == pytest.approx(expected, rel=1e-12)
    sim.train()
    assert mesh_model.training


@pytest.mark.parametrize("how", ["compile", "simulate"])
def test_a_step_inside_no_grad_or_autocast_is_refused_and_changes_nothing(how):
    """Under torch.autocast a float32 program's step cast its own ops and took no update (the loss
    stayed where it was); under torch.no_grad() usc.compile's step raised torch's "does not require
    grad" while the simulator's ranks, on threads where the mode does not follow, trained. Both are
    refused by name, before anything runs."""
    batch = token_batch(32, 4, 8)
    _, model = _dropout_reference(batch)
    plan = "dp=1" if how == "compile" else "dp=2"
    program = (usc.compile if how == "compile" else usc.simulate)(model, plan, example_inputs=batch, optimizer=_sgd)
    program.step(*batch)
    before = {k: v.clone() for k, v in program.full_state_dict().items()}
    for context, match in [(torch.no_grad, r"gradients off \(inside torch.no_grad\(\)"),
                           (torch.inference_mode, "gradients off"),
                           (lambda: torch.autocast("cpu", dtype=torch.bfloat16),
                            r"(?s)inside torch.autocast\('cpu', dtype=torch.bfloat16\).*fix: put the precision in the plan")]:
        with context(), pytest.raises(usc.StepContextError, match=match):
            program.step(*batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        for evaluate in (program.eval_step, program):
            with pytest.raises(usc.StepContextError, match="autocast"):
                evaluate(*batch)
    with torch.no_grad():  # evaluation takes no gradients: allowed there
        assert program.eval_step(*batch) == pytest.approx(program.eval_step(*batch))
    after = program.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert program.step(*batch) != program.step(*batch)  # and outside them, it trains


def test_a_last_partial_batch_is_named_with_its_fix():
    """A data loader's last batch with fewer rows than compiled: refused, naming drop_last=True; a
    batch of another length is refused without that hint."""
    batch = token_batch(32, 4, 8)
    _, model = _dropout_reference(batch)
    sim = usc.simulate(model, "dp=2", example_inputs=batch, optimizer=_sgd)
    with pytest.raises(usc.BadInput, match=r"has shape \[3, 8\] .*last, partial batch .*drop_last=True"):
        sim.step(*(t[:3] for t in batch))
    with pytest.raises(usc.BadInput, match=r"compile again for another\)\n"):
        sim.step(*(t[:, :6] for t in batch))


def test_a_step_in_eval_mode_trains_without_dropout():
    """torch: model.eval(); loss.backward(); opt.step() trains without dropout. So does usc."""
    batches = [token_batch(32, 4, 8, seed=s) for s in range(2)]
    reference, mesh_model = _dropout_reference(batches[0])
    reference.eval()
    expected, _ = _one_device(reference, batches, math.inf)
    sim = usc.simulate(mesh_model, "dp=2", example_inputs=batches[0], optimizer=_sgd).eval()
    # Hugging Face computes the loss on logits.float(): float32 rounding of the loss, not of the run
    assert [sim.step(*b) for b in batches] == pytest.approx(expected, rel=1e-6)
    full = sim.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-6, atol=1e-7)  # float32 loss gradient


def test_lint_lists_the_clipping_collectives():
    batch = token_batch(128, 4, 16)
    report = usc.lint(TinyLlama(), "dp=2 tp=2 pp=2 mb=2", example_inputs=batch)
    assert [(c.kind, c.axis, c.dtype, c.calls_per_step) for c in report.clipping] == [
        ("all-reduce", "dp", "float64", 1), ("all-reduce", "tp", "float64", 1), ("all-reduce", "pp", "float64", 1)]
    assert "max_grad_norm" in str(report) and report.to_dict()["clipping_collectives"]
    sim = usc.simulate(TinyLlama(), "dp=2 tp=2", example_inputs=batch)
    comm = sim.ranks[0].mesh.comm("tp")
    sim.step(*batch)
    before = comm.stats.calls.get("all-reduce", 0)
    sim.step(*batch)
    plain = comm.stats.calls["all-reduce"] - before
    sim.step(*batch, max_grad_norm=1.0)
    assert comm.stats.calls["all-reduce"] - before - plain == plain + 1  # exactly one more, as listed
