"""The model handed to usc.compile, after the compiled program trained past it: each rank trains its
own copy of the state, so the module the user holds keeps the values it was compiled with. Calling it
or saving its state_dict then would be the untrained model with no error (as it was: the model's eager
loss after three steps was its loss before them); usc refuses both until the trained values are loaded
back, and a model loaded back equals the program."""

import copy
import sys

import pytest
import torch
from torch import nn

import usc

transformers = pytest.importorskip("transformers")

VOCAB = 97


def llama():
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def batch(seed: int) -> dict:
    ids = torch.randint(0, VOCAB, (4, 7), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def eager_loss(model, b) -> float:
    with torch.no_grad():
        return float(model(**b).loss)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_a_trained_model_refuses_calls_and_saves_until_its_trained_values_are_loaded_back(plan, tmp_path):
    torch.manual_seed(0)
    model = llama()
    before = eager_loss(model, batch(1))
    sim = usc.simulate(model, plan, example_inputs=batch(0), optimizer=sgd)
    assert eager_loss(model, batch(1)) == before  # made, not trained: still level
    for seed in range(3):
        sim.step(batch(seed))
    with pytest.raises(usc.ModelOutOfDate, match=r"(?s)LlamaForCausalLM was called after.*3 step\(s\) taken.*"
                                                 r"fix: model.load_state_dict\(step.full_state_dict\(\)\)"):
        model(**batch(1))
    with pytest.raises(usc.ModelOutOfDate, match="had its state_dict read"):
        model.state_dict()
    with pytest.raises(usc.ModelOutOfDate):
        model.save_pretrained(tmp_path)  # Hugging Face's save reads the state_dict
    model.load_state_dict(sim.full_state_dict())
    trained = eager_loss(model, batch(1))
    assert trained < before - 0.05  # the trained model, not the one compiled
    assert trained == pytest.approx(sim.eval_step(batch(1)), rel=1e-5)
    model.save_pretrained(tmp_path)
    sim.step(batch(3))
    with pytest.raises(usc.ModelOutOfDate, match="4 step"):
        model(**batch(1))


def test_a_checkpoint_load_moves_the_program_past_the_model(tmp_path):
    torch.manual_seed(1)
    trained = usc.simulate(llama(), "dp=2", example_inputs=batch(0), optimizer=sgd)
    trained.step(batch(0))
    trained.save(tmp_path / "ckpt")
    model = llama()
    sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    sim.load(tmp_path / "ckpt")
    with pytest.raises(usc.ModelOutOfDate, match="1 checkpoint"):
        model(**batch(1))


def test_copies_of_the_model_and_a_model_built_on_meta():
    """A copy taken beside the compile is the user's own model: never refused. A model built on the
    meta device holds no values to mistake for trained ones (its forward makes meta tensors): not
    refused, and compiled again as often as wanted; once the trained values are loaded into it
    (assign=True) it is a real model, refused again after the next step."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(6, 5)

    def loss_fn(out, target):
        return ((out - target) ** 2).mean()

    y = torch.randn(6, 3)
    sim = usc.simulate(model, "dp=2", example_inputs=(x, y), loss_fn=loss_fn, optimizer=sgd)
    kept = copy.deepcopy(model)
    sim.step(x, y)
    kept(x)
    with pytest.raises(usc.ModelOutOfDate, match="Sequential was called"):
        model(x)

    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    meta_sim = usc.simulate(on_meta, "dp=2", example_inputs=(x, y), loss_fn=loss_fn, optimizer=sgd)
    meta_sim.step(x, y)
    usc.simulate(on_meta, "dp=2 zero=1", example_inputs=(x, y), loss_fn=loss_fn, optimizer=sgd)
    on_meta.load_state_dict(meta_sim.full_state_dict(), assign=True)
    assert torch.allclose(loss_fn(on_meta(x), y), torch.tensor(meta_sim.eval_step(x, y), dtype=torch.float32))
    meta_sim.step(x, y)
    with pytest.raises(usc.ModelOutOfDate, match="2 step"):
        on_meta(x)


def test_compiling_the_trained_model_again_takes_its_trained_values():
    """A second compile of the model reads its values: refused while it is behind the first program,
    and from the trained values once they are loaded back."""
    torch.manual_seed(3)
    model = llama()
    first = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    first.step(batch(0))
    with pytest.raises(usc.ModelOutOfDate, match="LlamaForCausalLM was compiled again"):
        usc.simulate(model, "tp=2", example_inputs=batch(0), optimizer=sgd)
    usc.lint(model, "tp=2", example_inputs=batch(0))  # a trace reads no values: not refused
    model.load_state_dict(first.full_state_dict())
    second = usc.simulate(model, "tp=2", example_inputs=batch(0), optimizer=sgd)
    assert second.eval_step(batch(1)) == pytest.approx(first.eval_step(batch(1)), rel=1e-5)


def test_a_compiled_process_guards_its_model_too():
    """usc.compile in one process (the rank torchrun would run): the same guard, the same way back."""
    torch.manual_seed(4)
    model = llama()
    step = usc.compile(model, "dp=1", example_inputs=batch(0), optimizer=sgd)
    step.step(batch(0))
    with pytest.raises(usc.ModelOutOfDate, match="1 step"):
        model(**batch(1))
    model.load_state_dict(step.full_state_dict())
    assert eager_loss(model, batch(1)) == pytest.approx(step.eval_step(batch(1)), rel=1e-5)


def test_freezing_or_unfreezing_after_compile_is_refused_and_compiling_again_applies_it():
    """Gradual unfreezing, a backbone frozen after the first epochs: requires_grad set on the model
    after compile was not seen by the program, which went on training what it was compiled to train
    (the frozen embedding kept moving, no error). Refused by name now; the fix it names applies it."""
    torch.manual_seed(5)
    model = llama()
    step = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    step.step(batch(0))
    model.model.embed_tokens.weight.requires_grad_(False)
    with pytest.raises(usc.ModelChanged, match=r"(?s)1 parameter\(s\) frozen \('model.embed_tokens.weight'\).*"
                                               r"fix: compile again from the trained values"):
        step.step(batch(1))
    model.load_state_dict(step.full_state_dict())
    again = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    embedding = again.full_state_dict()["model.embed_tokens.weight"].clone()
    again.step(batch(1))
    after = again.full_state_dict()
    assert torch.equal(after["model.embed_tokens.weight"], embedding)
    assert not torch.equal(after["lm_head.weight"], step.full_state_dict()["lm_head.weight"])

    model.model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(usc.ModelChanged, match=r"1 parameter\(s\) unfrozen \('model.embed_tokens.weight'\)"):
        again.step(batch(2))


def test_values_written_into_the_model_after_compile_are_refused_and_compiling_again_takes_them():
    """``usc.compile(model)``, then ``model.load_state_dict(pretrained)``, then steps: the program had
    read the model's values when it was made, so it trained from the random ones (the loss of the
    first step was the untrained model's, no error). Refused by name now, as is an in-place write;
    compiling again starts from the values loaded."""
    torch.manual_seed(6)
    model, pretrained = llama(), llama()
    step = usc.compile(model, "dp=1", example_inputs=batch(0), optimizer=sgd)
    model.load_state_dict(pretrained.state_dict())
    with pytest.raises(usc.ModelChanged, match=r"(?s)values were written after the compiled program read them.*"
                                               r"compile again now"):
        step.step(batch(0))
    again = usc.compile(model, "dp=1", example_inputs=batch(0), optimizer=sgd)
    assert again.step(batch(0)) == pytest.approx(eager_loss(pretrained, batch(0)), rel=1e-5)

    held = llama()
    sim2 = usc.simulate(held, "dp=2", example_inputs=batch(0), optimizer=sgd)
    with torch.no_grad():
        held.lm_head.weight.mul_(0.5)
    with pytest.raises(usc.ModelChanged, match="'lm_head.weight'"):
        sim2.step(batch(0))


class Tempered(nn.Module):
    """A user's wrapper around a model they did not write: logits over a temperature (distillation,
    calibration), and a class-level switch an instance may override."""

    boost = 1.0

    def __init__(self, inner, temperature: float):
        super().__init__()
        self.inner, self.temperature = inner, temperature

    def forward(self, input_ids, labels):
        logits = self.inner(input_ids=input_ids).logits * self.boost / self.temperature
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def tempered_loss(model, b) -> float:
    with torch.no_grad():
        return float(model(b["input_ids"], b["labels"]))


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_an_attribute_forward_reads_set_after_compile_is_refused_and_compiling_again_follows_it(plan):
    """A plain attribute forward reads is a constant of the trace: set after compile, the program kept
    the traced value (a temperature from 2.0 to 1.0 left the loss as it was, no error). Refused by name
    now, in training and in evaluation; compiling again takes the new value."""
    torch.manual_seed(7)
    model = Tempered(llama(), temperature=2.0)
    sim = usc.simulate(model, plan, example_inputs=(batch(0)["input_ids"], batch(0)["labels"]), optimizer=sgd)
    sim.step(batch(0)["input_ids"], batch(0)["labels"])
    model.temperature = 1.0
    for call in (lambda: sim.step(batch(1)["input_ids"], batch(1)["labels"]),
                 lambda: sim.eval_step(batch(1)["input_ids"], batch(1)["labels"])):
        with pytest.raises(usc.ModelChanged, match=r"(?s)Tempered.temperature was set after usc.compile \(2.0 when "
                                                   r"traced, 1.0 now\).*fix: set it before compiling, or compile again"):
            call()
    model.load_state_dict(sim.full_state_dict())
    again = usc.simulate(model, plan, example_inputs=(batch(0)["input_ids"], batch(0)["labels"]), optimizer=sgd)
    assert again.eval_step(batch(1)["input_ids"], batch(1)["labels"]) == pytest.approx(
        tempered_loss(model, batch(1)), rel=1e-5)

    Tempered.boost = 3.0  # a class default moves: every instance reads it (the wrapper's own class)
    try:
        with pytest.raises(usc.ModelChanged, match=r"Tempered.boost was set after usc.compile"):
            again.step(batch(1)["input_ids"], batch(1)["labels"])
    finally:
        Tempered.boost = 1.0
    model.boost = 3.0  # an instance attribute over the class default the trace read
    with pytest.raises(usc.ModelChanged, match=r"Tempered.boost was set after usc.compile \(1.0 when traced, 3.0 now\)"):
        again.step(batch(1)["input_ids"], batch(1)["labels"])


def test_a_dropout_rate_set_after_compile_is_refused():
    """Scheduling dropout (``module.p = rate`` as training goes on) on Hugging Face's GPT-2."""
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=24, n_layer=2, n_head=4)
    model = transformers.GPT2LMHeadModel(config)
    sim = usc.simulate(model, "tp=2", example_inputs=batch(0), optimizer=sgd)
    sim.step(batch(0))
    model.transformer.h[1].attn.resid_dropout.p = 0.0
    with pytest.raises(usc.ModelChanged, match=r"GPT2LMHeadModel.transformer.h.1.attn.resid_dropout.p was set after "
                                               r"usc.compile \(0.1 when traced, 0.0 now\)"):
        sim.step(batch(1))


def test_activation_checkpointing_switched_on_after_compile_points_to_the_plan():
    """Hugging Face's ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before
    it) after compile sets a flag its layers read: refused, naming the plan's own recompute."""
    torch.manual_seed(15)
    model = llama()
    sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    sim.step(batch(0))
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    with pytest.raises(usc.ModelChanged, match=r"(?s)gradient_checkpointing was set after usc.compile \(False when "
                                               r"traced, True now.*recompute=full or recompute=selective"):
        sim.step(batch(1))


def test_attributes_forward_does_not_read_are_the_users_own():
    """Bookkeeping kept on the model (an epoch count, notes, the config's generation switches forward
    does not reach in training) is not refused, and the steps are the steps of a model without it."""
    losses = []
    for bookkeeping in (False, True):
        torch.manual_seed(8)
        model = llama()
        sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
        sim.step(batch(0))
        if bookkeeping:
            model.epoch, model.notes = 3, {"lr": [0.1, 0.2]}
            model.model.layers[0].seen_tokens = 1234
        losses.append([sim.step(batch(1)), sim.step(batch(2))])
    assert losses[0] == losses[1]


def test_an_adapter_injected_after_compile_is_refused():
    """A low-rank adapter wrapped around a layer after compile (as PEFT injects one): the program runs
    the modules it traced, so it trained without the adapter, no error. Refused, naming what came."""

    class LoRA(nn.Module):
        def __init__(self, base: nn.Linear, rank: int = 3):
            super().__init__()
            self.base = base
            self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
            self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + x @ self.lora_a.T @ self.lora_b.T

    torch.manual_seed(9)
    model = llama()
    sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    attention = model.model.layers[0].self_attn
    attention.q_proj = LoRA(attention.q_proj)
    with pytest.raises(usc.ModelChanged, match=r"(?s)parameters or buffers changed after usc.compile, 3 added "
                                               r"\('model.layers.0.self_attn.q_proj.base.weight' and 2 more\) and 1 "
                                               r"removed \('model.layers.0.self_attn.q_proj.weight'\).*change the model "
                                               r"before compiling"):
        sim.step(batch(0))


def test_buffers_written_after_compile_are_refused():
    """A buffer written after compile (a RoPE frequency rescaled for a longer context; a batch norm's
    running statistics moved by calling the model in training mode) is not what the program holds."""
    torch.manual_seed(10)
    model = llama()
    sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    with torch.no_grad():
        model.model.rotary_emb.inv_freq.mul_(0.25)
    with pytest.raises(usc.ModelChanged, match=r"parameter\(s\) or buffer\(s\): 'model.rotary_emb.inv_freq'"):
        sim.step(batch(0))

    net = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 1))
    x, y = torch.randn(6, 5), torch.randn(6, 1)
    sim = usc.simulate(net, "dp=2", example_inputs=(x, y), loss_fn=nn.functional.mse_loss, optimizer=sgd)
    net(x)  # the model is level (no step yet): calling it is allowed, and moves its running statistics
    with pytest.raises(usc.ModelChanged, match=r"buffer\(s\): '1.num_batches_tracked'"):
        sim.step(x, y)


AUX_WEIGHT = 0.25
Z_SCALE = 1.0


def z_loss(logits):
    """A helper of the model's Python module, reading a module-level name of its own."""
    return logits.float().logsumexp(-1).square().mean() * Z_SCALE


class WithAux(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, labels):
        out = self.inner(input_ids=input_ids, labels=labels)
        return out.loss + AUX_WEIGHT * z_loss(out.logits)


def test_module_level_names_the_model_reads_set_after_compile_are_refused(monkeypatch):
    """A loss weight kept at module level and annealed by the training script (``AUX_WEIGHT = 0.5``
    between steps) is a constant of the trace: the program kept 0.25, no error. Refused by name, as is
    a name a helper the forward calls reads; the script's other names are its own."""
    torch.manual_seed(11)
    model = WithAux(llama())
    b = (batch(0)["input_ids"], batch(0)["labels"])
    sim = usc.simulate(model, "tp=2", example_inputs=b, optimizer=sgd)
    sim.step(*b)
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "AUX_WEIGHT", 0.5)
    with pytest.raises(usc.ModelChanged, match=rf"{__name__}.AUX_WEIGHT was set after usc.compile \(0.25 when traced, "
                                               r"0.5 now\).*"):
        sim.step(*b)
    monkeypatch.setattr(here, "AUX_WEIGHT", 0.25)
    monkeypatch.setattr(here, "Z_SCALE", 2.0)
    with pytest.raises(usc.ModelChanged, match=rf"{__name__}.Z_SCALE was set after usc.compile"):
        sim.eval_step(*b)
    monkeypatch.setattr(here, "Z_SCALE", 1.0)
    monkeypatch.setattr(here, "VOCAB", VOCAB)  # a name nothing in the model reads: the test's own
    sim.step(*b)


def test_a_loss_functions_closure_set_after_compile_is_refused_and_compiling_again_follows_it():
    """A loss function whose weight the training loop changes through its closure (label smoothing
    scheduled): the program kept the traced value. Refused by name; compiling again takes it."""

    def make_loss():
        smoothing = 0.0

        def loss_fn(out, labels):
            return nn.functional.cross_entropy(out.logits.flatten(0, 1), labels.flatten(), label_smoothing=smoothing)

        def schedule(value):
            nonlocal smoothing
            smoothing = value

        return loss_fn, schedule

    torch.manual_seed(12)
    model = llama()
    loss_fn, schedule = make_loss()
    b = (batch(0)["input_ids"], batch(0)["labels"])
    sim = usc.simulate(model, "dp=2", example_inputs=b, loss_fn=loss_fn, optimizer=sgd)
    copy.deepcopy(model)  # a copy beside the compile (an EMA's start): the watch on the loss is not copied
    sim.step(*b)
    schedule(0.2)
    with pytest.raises(usc.ModelChanged, match=r"(?s)smoothing in .*loss_fn's closure was set after usc.compile "
                                               r"\(0.0 when traced, 0.2 now\).*belongs in the batch"):
        sim.step(*b)
    model.load_state_dict(sim.full_state_dict())
    again = usc.simulate(model, "dp=2", example_inputs=b, loss_fn=loss_fn, optimizer=sgd)
    with torch.no_grad():
        expected = float(loss_fn(model(input_ids=b[0]), b[1]))
    assert again.eval_step(*b) == pytest.approx(expected, rel=1e-5)


def test_the_models_own_tensors_refuse_their_values_while_it_is_behind():
    """An average of weights kept over ``model.parameters()`` (torch's ``AveragedModel``, an EMA of the
    model) read the tensors the model was compiled with: the average of untrained weights, no error.
    Once the program has moved past the model its tensors refuse any use of their values, naming
    the tensor; their metadata stays (counting, zero_grad, dtype); loading the trained values back
    makes them plain tensors again, and then the average is of trained weights."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(13)
    model = llama()
    count = sum(p.numel() for p in model.parameters())  # read before anything guards the tensors
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))  # a copy: the user's own
    sim = usc.simulate(model, "tp=2", example_inputs=batch(0), optimizer=sgd)
    sim.step(batch(0))
    with pytest.raises(usc.ModelOutOfDate, match=r"(?s)LlamaForCausalLM's tensor '[\w.]+' was used after usc's "
                                                 r"compiled program moved past it \(1 step\(s\) taken.*"
                                                 r"fix: read the trained values from the program"):
        ema.update_parameters(model)
    assert sum(p.numel() for p in model.parameters()) == count  # metadata: still answered
    model.zero_grad()
    assert next(model.parameters()).dtype == torch.float32
    with pytest.raises(usc.ModelOutOfDate, match="was used after"):
        copy.deepcopy(model)  # a copy of the untrained values
    with pytest.raises(usc.ModelOutOfDate, match="was used after"):
        with torch.no_grad():
            model.lm_head.weight.mul_(2.0)

    model.load_state_dict(sim.full_state_dict())
    assert all(type(p) is nn.Parameter for p in model.parameters())
    ema.update_parameters(model)
    trained = sim.full_state_dict()["lm_head.weight"]
    assert torch.allclose(ema.module.lm_head.weight, trained)  # the first update copies: the trained weights
    sim.step(batch(1))
    with pytest.raises(usc.ModelOutOfDate):
        ema.update_parameters(model)


def test_the_guard_on_the_models_tensors_steps_aside_for_usc_and_for_a_gone_program():
    """usc's own traces of a model left behind (lint) read its tensors' metadata only; with the program
    gone, the model's own tensors are the only state there is, and usable."""
    torch.manual_seed(14)
    model = llama()
    sim = usc.simulate(model, "dp=2", example_inputs=batch(0), optimizer=sgd)
    sim.step(batch(0))
    usc.lint(model, "tp=2", example_inputs=batch(0))
    del sim
    import gc

    gc.collect()
    assert eager_loss(model, batch(1)) > 0
    assert all(type(p) is nn.Parameter for p in model.parameters())
