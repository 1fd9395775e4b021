"""Cross-entropy as users write it: label smoothing, class weights, another ignore_index, a sum, and
classes in dim 1 ([N, C, S] logits), under every axis that splits the loss's tokens or its
vocabulary. usc rewrites the loss so its pieces shard (the vocabulary-parallel cross-entropy under
tp; sums over a global count under dp, cp and microbatches); each option must keep PyTorch's
definition: smoothing spreads eps / C of the (class-weighted) mass over every class, and a weighted
mean divides by the weights of the counted tokens' classes. float64 and SGD steps, so a term off
by a factor or a wrong denominator shows."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from usc.testing import assert_equivalent

VOCAB, HIDDEN, FFN = 98, 24, 40


class TokenClassifier(nn.Module):
    """An embedding, one MLP pair (tp splits it) and a head onto the vocabulary; the loss is
    ``F.cross_entropy(..., **options)``, with a class-weight buffer when ``weight`` is asked for."""

    def __init__(self, options: dict, classes_dim1: bool = False) -> None:
        super().__init__()
        self.options, self.classes_dim1 = dict(options), classes_dim1
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        if self.options.pop("weight", False):
            self.register_buffer("class_weight", torch.rand(VOCAB, generator=torch.Generator().manual_seed(3)) + 0.5)
        else:
            self.class_weight = None

    def forward(self, ids, labels):
        h = self.emb(ids)
        logits = self.head(h + self.down(torch.relu(self.up(h))))
        if self.classes_dim1:  # [B, C, S], as segmentation-style code passes it
            return F.cross_entropy(logits.transpose(1, 2), labels, weight=self.class_weight, **self.options)
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), weight=self.class_weight,
                               **self.options)


def batch(ignore_index: int = -100):
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, VOCAB, (6, 10), generator=g), torch.randint(0, VOCAB, (6, 10), generator=g)
    labels[1, :4] = ignore_index  # ranks and microbatches count different numbers of tokens
    labels[4, 7:] = ignore_index
    return ids, labels


OPTIONS = {
    "smoothing": dict(label_smoothing=0.1),
    "weight": dict(weight=True),
    "weight+smoothing": dict(weight=True, label_smoothing=0.2),
    "ignore_index=5": dict(ignore_index=5),
    "smoothing+sum+ignore_index": dict(label_smoothing=0.1, reduction="sum", ignore_index=5),
}
PLANS = ["dp=2", "dp=3 mb=2", "tp=2", "dp=2 tp=2 sp=on", "pp=2 mb=3", "cp=2"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_cross_entropy_options_equal_one_device(name, plan):
    options = OPTIONS[name]
    batches = [batch(options.get("ignore_index", -100))] * 2
    result = assert_equivalent(lambda: TokenClassifier(options).double(), plan, batches, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("plan", ["dp=2", "cp=2", "tp=2"])
def test_classes_in_dim_1_with_weights_and_smoothing(plan):
    options = dict(weight=True, label_smoothing=0.1)
    result = assert_equivalent(lambda: TokenClassifier(options, classes_dim1=True).double(), plan, [batch()] * 2,
                               optimizer=sgd, rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


class SoftTargets(TokenClassifier):
    """Cross-entropy against class probabilities (distillation, mixup): the target is a softmax of
    the labels' one-hot rows mixed with a fixed distribution."""

    def forward(self, ids, labels):
        h = self.emb(ids)
        logits = self.head(h + self.down(torch.relu(self.up(h))))
        mixed = 0.7 * F.one_hot(labels.clamp(min=0), VOCAB).to(logits.dtype) + 0.3 * torch.softmax(self.class_weight_or_ones(), 0)
        if self.classes_dim1:
            return F.cross_entropy(logits.transpose(1, 2), mixed.transpose(1, 2), weight=self.class_weight,
                                   **self.options)
        return F.cross_entropy(logits.reshape(-1, VOCAB), mixed.reshape(-1, VOCAB), weight=self.class_weight,
                               **self.options)

    def class_weight_or_ones(self):
        return self.class_weight if self.class_weight is not None else torch.linspace(0, 1, VOCAB, dtype=self.head.weight.dtype)


SOFT = {"soft": {}, "soft+weight+smoothing": dict(weight=True, label_smoothing=0.1), "soft+sum": dict(reduction="sum")}


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("name", sorted(SOFT))
def test_probability_targets_equal_one_device(name, plan):
    """PyTorch's mean over probability targets divides by the number of samples, weights or not."""
    result = assert_equivalent(lambda: SoftTargets(SOFT[name]).double(), plan, [batch()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("plan", ["dp=2", "cp=2", "tp=2"])
def test_probability_targets_with_classes_in_dim_1(plan):
    result = assert_equivalent(lambda: SoftTargets(dict(weight=True), classes_dim1=True).double(), plan, [batch()] * 2,
                               optimizer=sgd, rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_probability_targets_flattened_keep_their_sequence_split():
    """``ce(x.view(-1, C), t.view(-1, C))`` is the loss on [B, S, C]: under cp nothing is gathered
    (the flatten gathered the logits and the targets over cp)."""
    import usc

    report = usc.lint(SoftTargets({}), "cp=2", example_inputs=batch())
    assert [c for c in report.collectives if c.kind == "all-gather"] == []
