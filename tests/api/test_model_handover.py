"""The model handed to usc.compile, after the compiled program trained past it: each rank trains its
own copy of the state, so the module the user holds keeps the values it was compiled with. Calling it
or saving its state_dict then would be the untrained model with no error (as it was: the model's eager
loss after three steps was its loss before them); usc refuses both until the trained values are loaded
back, and a model loaded back equals the program."""

import copy

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
