"""Evaluation as the model's own ``eval()`` computes it. The compiled program evaluates with its
training forward, dropout off; a model whose evaluation differs in more than dropout (batch norm's
running statistics, a branch on ``self.training``) was evaluated with its training forward, silently
(a batch-norm network's ``eval_step`` gave its training-mode loss, 0.4397 against eager eval's
0.2774). Such an evaluation is refused by name now; one that differs only in dropout runs, and equals
eager ``model.eval()``."""

import copy

import pytest
import torch
from torch import nn

import usc

transformers = pytest.importorskip("transformers")


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


class DropPath(nn.Module):
    """Stochastic depth as vision models write it: the residual branch dropped per sample in training."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x):
        if not self.training or self.p == 0.0:
            return x
        keep = x.new_empty(x.shape[0], 1).bernoulli_(1 - self.p)
        return x * keep / (1 - self.p)


class Block(nn.Module):
    def __init__(self, width: int, p: float):
        super().__init__()
        self.mlp, self.drop_path = nn.Linear(width, width), DropPath(p)

    def forward(self, x):
        return x + self.drop_path(torch.tanh(self.mlp(x)))


@pytest.mark.parametrize("plan", ["dp=2", "dp=3 mb=2"])
def test_batch_norm_is_refused_in_evaluation_and_trains_as_before(plan):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 1)).double()
    x, y = torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    if "mb" in plan:  # batch statistics under microbatches: refused at compile, as before
        with pytest.raises(usc.PlanError, match="running_mean"):
            usc.simulate(net, plan, example_inputs=(x, y), loss_fn=nn.functional.mse_loss, optimizer=sgd)
        return
    reference = copy.deepcopy(net)
    sim = usc.simulate(net, plan, example_inputs=(x, y), loss_fn=nn.functional.mse_loss, optimizer=sgd)
    loss = sim.step(x, y)
    with torch.no_grad():
        assert loss == pytest.approx(float(nn.functional.mse_loss(reference(x), y)), rel=1e-12)
    with pytest.raises(usc.EvalModeError, match=r"(?s)module '1' \(BatchNorm1d\) runs .*_native_batch_norm_legit_functional"
                                                r".* in training where evaluation runs batch_norm.*fix: evaluate "
                                                r"with the model itself"):
        sim.eval_step(x, y)
    net.eval()  # the model's mode is the program's: step(*batch) evaluates in eval mode now
    with pytest.raises(usc.EvalModeError):
        sim(x, y)
    net.train()
    assert sim(x, y) > 0  # the training forward, as asked: no update


def test_a_branch_on_self_training_is_refused_in_evaluation():
    """Stochastic depth (a draw in training, the identity in evaluation)."""
    torch.manual_seed(1)
    model = nn.Sequential(Block(6, 0.3), Block(6, 0.3), nn.Linear(6, 1)).double()
    x, y = torch.randn(6, 6, dtype=torch.float64), torch.randn(6, 1, dtype=torch.float64)
    sim = usc.simulate(model, "dp=2", example_inputs=(x, y), loss_fn=nn.functional.mse_loss, optimizer=sgd)
    sim.step(x, y)
    with pytest.raises(usc.EvalModeError, match=r"module '0.drop_path' \(DropPath\) runs new_empty.default, "
                                                r"bernoulli.p, .* in training only"):
        sim.eval_step(x, y)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_a_model_whose_evaluation_is_dropout_off_evaluates_as_eager_eval(plan):
    """Hugging Face's GPT-2 with its dropouts (embedding, attention, residual): evaluation differs only
    in dropout, which the program turns off; not refused, and equal to eager model.eval()."""
    config = transformers.GPT2Config(vocab_size=61, n_positions=16, n_embd=24, n_layer=2, n_head=4,
                                     attn_pdrop=0.2, resid_pdrop=0.2, embd_pdrop=0.2)
    torch.manual_seed(2)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 61, (4, 9), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    sim = usc.simulate(model, plan, example_inputs=batch, optimizer=sgd)
    sim.step(batch)
    evaluated = sim.eval_step(batch)
    model.load_state_dict(sim.full_state_dict())
    model.eval()
    with torch.no_grad():
        assert evaluated == pytest.approx(float(model(**batch).loss), rel=1e-5)
