"""Losses as users write them, other than a plain cross-entropy: nll after log_softmax, regression
and multi-label losses, KL divergence, a per-token cross-entropy the user averages, a masked mean
written as a ratio of sums. Each equals one device under every axis that splits the batch or the
sequence (float64, SGD, 1e-10), microbatches included: a loss op with a reduction runs as its
per-element form and a sum or a mean over the global count (the inputs are not gathered), and a
ratio of two batch sums whose denominator reads no weight weighs microbatches by their
denominators, as a token mean does. What cannot combine over microbatches is refused by name."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from usc.testing import assert_equivalent

VOCAB, HIDDEN, FFN = 98, 24, 40
IGNORED = 7


class Tagger(nn.Module):
    def __init__(self, loss: str) -> None:
        super().__init__()
        self.loss = loss
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, VOCAB))

    def forward(self, ids, labels):
        h = self.emb(ids)
        z = self.head(h + self.down(torch.relu(self.up(h))))
        flat, y = z.reshape(-1, VOCAB), labels.reshape(-1)
        per_token = F.cross_entropy(flat, y, reduction="none")
        counted = (y != IGNORED).to(z.dtype)
        signs = (labels % 2).to(z.dtype) * 2 - 1
        rows = [z[..., 8 * i:8 * i + 8].reshape(-1, 8) for i in range(3)]
        return {
            "nll": lambda: F.nll_loss(F.log_softmax(z, -1).reshape(-1, VOCAB), y),
            "nll_ignore_index": lambda: F.nll_loss(F.log_softmax(z, -1).reshape(-1, VOCAB), y, ignore_index=IGNORED),
            "mse": lambda: F.mse_loss(z.mean(-1), labels.to(z.dtype) / VOCAB),
            "smooth_l1_sum": lambda: F.smooth_l1_loss(z[..., 0], labels.to(z.dtype) / VOCAB, reduction="sum", beta=0.5),
            "bce_with_logits": lambda: F.binary_cross_entropy_with_logits(
                z, F.one_hot(labels, VOCAB).to(z.dtype), pos_weight=self.scale),
            "kl_sum": lambda: F.kl_div(F.log_softmax(z, -1), F.softmax(0.5 * z.detach(), -1), reduction="sum"),
            "per_token_mean": lambda: per_token.mean(),
            "masked_mean": lambda: (per_token * counted).sum() / counted.sum(),
            # a denominator that does not depend on the batch: a sum scaled by a constant
            "over_a_constant": lambda: (per_token * counted).sum() / self.scale.sum(),
            # element-wise losses of pairs, and losses of rows (each sample's features to one value)
            "margin_ranking": lambda: F.margin_ranking_loss(z[..., 0], z[..., 1], signs),
            "hinge_embedding": lambda: F.hinge_embedding_loss(z[..., 0], signs, margin=0.5),
            "poisson_nll": lambda: F.poisson_nll_loss(z[..., 0], labels.to(z.dtype) / VOCAB),
            "cosine_embedding": lambda: F.cosine_embedding_loss(rows[0], rows[1], signs.reshape(-1), margin=0.1),
            "triplet": lambda: F.triplet_margin_loss(*rows),
            "multi_margin": lambda: F.multi_margin_loss(z.reshape(-1, VOCAB), y),
            "multilabel_margin": lambda: F.multilabel_margin_loss(  # each row: two classes, then -1s
                z.reshape(-1, VOCAB), torch.cat([torch.stack([y, (y + 3) % VOCAB], 1),
                                                 torch.full((y.shape[0], VOCAB - 2), -1, dtype=y.dtype)], 1)),
            # a preference loss of two scores per sample (log_sigmoid had no rule: it gathered the batch)
            "log_sigmoid_pairs": lambda: -F.logsigmoid(z[..., 0] - z[..., 1]).mean(),
        }[self.loss]()


def batch(rows: int = 6):
    g = torch.Generator().manual_seed(0)
    ids, labels = torch.randint(0, VOCAB, (rows, 10), generator=g), torch.randint(0, VOCAB, (rows, 10), generator=g)
    labels[1, :4] = IGNORED  # microbatches count different numbers of tokens
    return ids, labels


LOSSES = ["nll", "nll_ignore_index", "mse", "smooth_l1_sum", "bce_with_logits", "kl_sum", "per_token_mean",
          "masked_mean", "over_a_constant", "margin_ranking", "hinge_embedding", "poisson_nll", "cosine_embedding",
          "triplet", "multi_margin", "multilabel_margin", "log_sigmoid_pairs"]
PLANS = ["dp=2", "dp=3 mb=2", "tp=2", "dp=2 tp=2 sp=on", "cp=2", "pp=2 mb=3"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("loss", LOSSES)
def test_losses_equal_one_device(loss, plan):
    result = assert_equivalent(lambda: Tagger(loss).double(), plan, [batch()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("loss", ["bce_with_logits", "margin_ranking", "cosine_embedding", "triplet", "multi_margin",
                                  "log_sigmoid_pairs"])
def test_a_reduced_loss_does_not_gather_its_inputs_over_dp(loss):
    report = usc.lint(Tagger(loss), "dp=2", example_inputs=batch())
    assert not [c for c in report.collectives if c.axis == "dp" and c.kind == "all-gather"]


class TokenMean(Tagger):
    """The plain token mean (cross-entropy ignoring IGNORED), for the all-ignored microbatch below."""

    def forward(self, ids, labels):
        h = self.emb(ids)
        z = self.head(h + self.down(torch.relu(self.up(h))))
        return F.cross_entropy(z.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=IGNORED)


@pytest.mark.parametrize("plan", ["mb=2", "dp=3 mb=2", "pp=2 mb=3", "dp=2"])
@pytest.mark.parametrize("model", [TokenMean, lambda loss: Tagger("masked_mean")], ids=["cross_entropy", "masked_mean"])
def test_a_microbatch_with_every_token_ignored_adds_nothing(model, plan):
    """Rows 0-2 all ignored: the first microbatch (and some ranks) count no token. Its mean was 0/0,
    NaN, which weighting by its count (0) did not remove: the step was refused as non-finite."""
    ids, labels = batch()
    labels[:3] = IGNORED
    result = assert_equivalent(lambda: model("masked_mean").double(), plan, [(ids, labels)] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


class Denominators(Tagger):
    """A masked mean as users write it: the numerator masked or not, the denominator kept off zero
    by a floor or an offset, a regularizer added. Rows 0-2 of the batch count nothing, so the first
    microbatch (and some ranks) divide by a count of 0."""

    def forward(self, ids, labels):
        h = self.emb(ids)
        z = self.head(h + self.down(torch.relu(self.up(h))))
        y = labels.reshape(-1)
        counted = (y != IGNORED).to(z.dtype)
        per_token = F.cross_entropy(z.reshape(-1, VOCAB), y, reduction="none")
        regularizer = 0.01 * self.up.weight.pow(2).sum() + 0.3
        return {
            # the numerator is not masked: a microbatch counting nothing still adds its sum
            "unmasked": lambda: per_token.sum() / counted.sum(),
            "unmasked_plus_regularizer": lambda: per_token.sum() / counted.sum() + regularizer,
            "cross_entropy_plus_regularizer": lambda: F.cross_entropy(z.reshape(-1, VOCAB), y, ignore_index=IGNORED)
            + regularizer,
            "clamped": lambda: (per_token * counted).sum() / counted.sum().clamp(min=1),
            "clamped_unmasked": lambda: per_token.sum() / counted.sum().clamp(min=1),
            "clamp_min": lambda: (per_token * counted).sum() / torch.clamp_min(counted.sum(), 2.5),
            "offset": lambda: per_token.sum() / (counted.sum() + 1e-3),
            # a z-loss masked and divided by the same count as the cross-entropy (two ratios, one count)
            "masked_z_loss": lambda: (per_token * counted).sum() / counted.sum()
            + 1e-2 * (torch.logsumexp(z.reshape(-1, VOCAB), -1).pow(2) * counted).sum() / counted.sum(),
            # the count as count_nonzero (it had no rule: refused under mb, gathered under dp)
            "count_nonzero": lambda: (per_token * counted).sum() / torch.count_nonzero(counted).clamp(min=1),
        }[self.loss]()


DENOMINATORS = ["unmasked", "unmasked_plus_regularizer", "cross_entropy_plus_regularizer", "clamped",
                "clamped_unmasked", "clamp_min", "offset", "masked_z_loss", "count_nonzero"]


def empty_start():
    ids, labels = batch()
    labels[:3] = IGNORED
    return ids, labels


@pytest.mark.parametrize("plan", ["mb=2", "dp=3 mb=2", "pp=2 mb=3", "dp=2", "tp=2 mb=2"])
@pytest.mark.parametrize("loss", DENOMINATORS)
def test_masked_means_as_written_equal_one_device(loss, plan):
    """Each microbatch's part of the step's loss sum is its numerator (plus the other terms times
    its count), not its mean times its count: a microbatch counting nothing divides by a guarded 1,
    and times 0 its numerator was dropped -- the unmasked forms trained on half the loss under mb."""
    result = assert_equivalent(lambda: Denominators(loss).double(), plan, [empty_start()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


def test_a_floored_count_holds_when_nothing_is_counted():
    """The whole batch counts nothing: the floor divides by 1 on one device (a finite step), and the
    step's count takes the same floor."""
    ids, labels = batch()
    labels[:] = IGNORED
    result = assert_equivalent(lambda: Denominators("clamped").double(), "dp=3 mb=2", [(ids, labels)] * 2,
                               optimizer=sgd, rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


class Scaled(Tagger):
    """A sum scaled by a number, which the trace holds as a constant: taken from the batch's shape
    (a mean over the batch, written by hand) or fixed. A microbatch's trace holds its own size."""

    def forward(self, ids, labels):
        z = self.head(self.emb(ids))
        per_token = F.cross_entropy(z.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
        return {
            "over_batch_size": lambda: per_token.sum() / ids.size(0),
            "times_reciprocal": lambda: per_token.sum() * (1.0 / ids.size(0)),
            "over_numel": lambda: per_token.sum() / labels.numel(),
            "kl_batchmean": lambda: F.kl_div(F.log_softmax(z, -1), F.softmax(0.5 * z.detach(), -1),
                                             reduction="batchmean"),
            "over_fixed_3": lambda: per_token.sum() / 3,
            "over_fixed_6": lambda: per_token.sum() / 6,
            "times_fixed_half": lambda: 0.5 * per_token.sum(),
            # the size made a tensor: a lifted constant, or a factory op holding the number
            "over_tensor_of_size": lambda: per_token.sum() / torch.tensor(ids.size(0), dtype=z.dtype),
            "over_new_tensor_of_size": lambda: per_token.sum() / z.new_tensor(ids.size(0)),
            "times_tensor_reciprocal": lambda: per_token.sum() * torch.tensor(1.0 / ids.size(0), dtype=z.dtype),
            "over_ones_summed": lambda: per_token.sum() / torch.ones(ids.size(0), dtype=z.dtype).sum(),
            "over_full": lambda: per_token.sum() / torch.full((), ids.size(0), dtype=z.dtype),
            # the number with another: distillation's batchmean times T^2
            "kl_batchmean_times_t2": lambda: 4.0 * F.kl_div(F.log_softmax(z / 2, -1), F.softmax(z.detach() / 3, -1),
                                                            reduction="batchmean"),
            # on the elements before the sum
            "elements_over_batch_size": lambda: (per_token / ids.size(0)).sum(),
            "elements_times_reciprocal": lambda: (per_token.view(ids.shape) * (1.0 / ids.size(0))).sum(),
            "elements_fixed_then_scaled": lambda: (per_token.view(-1) / 3.0).sum() * 2.0,
            # refused: a mean divided by the size again, and the size inside a nonlinear function
            "elements_over_batch_size_mean": lambda: (per_token / ids.size(0)).mean(),
            "inside_exp": lambda: (per_token / ids.size(0)).exp().sum(),
        }[self.loss]()


SCALES = ["over_batch_size", "times_reciprocal", "over_numel", "kl_batchmean", "over_fixed_3", "over_fixed_6",
          "times_fixed_half", "over_tensor_of_size", "over_new_tensor_of_size", "times_tensor_reciprocal",
          "over_ones_summed", "over_full", "kl_batchmean_times_t2", "elements_over_batch_size",
          "elements_times_reciprocal", "elements_fixed_then_scaled"]


@pytest.mark.parametrize("plan", ["mb=6", "mb=2", "dp=3 mb=2", "pp=2 mb=3"])
@pytest.mark.parametrize("loss", SCALES)
def test_a_scale_from_the_batch_shape_is_read_against_another_batch_size(loss, plan):
    """The trace of a microbatch holds its own size where the model reads the batch's: usc traces the
    model on one sample more and compares. ``* (1 / x.size(0))`` under any mb, and every batch-shaped
    divisor under microbatches of one sample (``mb=6``: a division by 1), trained on M times the
    loss; a divisor that is a multiple of the microbatch's size was refused, fixed or not."""
    result = assert_equivalent(lambda: Scaled(loss).double(), plan, [batch()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


class PerSample(Tagger):
    """The batch reduced inside the loss, before a reduction over the sequence; slices of the batch."""

    def forward(self, ids, labels):
        z = self.head(self.emb(ids))
        per_token = F.cross_entropy(z.reshape(-1, VOCAB), labels.reshape(-1), reduction="none").view(ids.shape)
        per_sample = per_token.mean(1)
        return {
            "mean_over_batch_then_sequence": lambda: per_token.mean(0).mean(),
            "sum_over_batch_over_its_size": lambda: (per_token.sum(0) / ids.size(0)).sum(),
            "sum_over_batch_then_sequence": lambda: per_token.sum(0).mean(),
            # a batch mean weighted per position by a tensor on its way to the term
            "weighted_mean_over_batch": lambda: (per_token.mean(0) * self.scale[:ids.size(1)]).sum(),
            "slice_by_size": lambda: per_sample[: ids.size(0)].mean(),
            "slice_from_minus_size": lambda: per_sample[-ids.size(0):].sum(),
            "fixed_slice": lambda: per_sample[:2].mean(),
            "fixed_tail": lambda: per_sample[-2:].mean(),
        }[self.loss]()


@pytest.mark.parametrize("plan", ["mb=6", "dp=3 mb=2", "pp=2 mb=3"])
@pytest.mark.parametrize("loss, refusal", [
    ("elements_over_batch_size_mean", "mean.default .* is scaled by .*, which may be taken from the shape"),
    ("inside_exp", "div.Tensor .* scales a value of the batch by .*, a number that follows the microbatch's size")])
def test_a_size_usc_cannot_read_is_refused_by_name(loss, refusal, plan):
    """A mean divided by the size again (not a sum over the microbatches, nor their mean), and the size
    inside a nonlinear function of the elements: named, where they trained on another loss."""
    with pytest.raises(usc.PlanError, match=refusal):
        usc.lint(Scaled(loss), plan, example_inputs=batch())


@pytest.mark.parametrize("plan", ["mb=6", "mb=2", "dp=3 mb=2", "pp=2 mb=3"])
@pytest.mark.parametrize("loss", ["mean_over_batch_then_sequence", "sum_over_batch_over_its_size",
                                  "sum_over_batch_then_sequence", "weighted_mean_over_batch", "slice_by_size",
                                  "slice_from_minus_size"])
def test_a_batch_reduced_inside_the_loss_combines_as_one_device(loss, plan):
    """A mean over the batch dim followed by a mean over the sequence was read as a sum (the value
    is partial over the batch split either way): M times the loss, silently."""
    result = assert_equivalent(lambda: PerSample(loss).double(), plan, [batch()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10


@pytest.mark.parametrize("plan", ["mb=6", "pp=2 mb=3"])
@pytest.mark.parametrize("loss", ["fixed_slice", "fixed_tail"])
def test_a_fixed_slice_of_the_batch_is_refused_where_a_microbatch_hides_it(loss, plan):
    """``x[:2]`` on a microbatch of 2 (or of 1) keeps it whole: no coupling in its trace, though on the
    batch it keeps 2 samples of 6. It trained on every sample, silently."""
    with pytest.raises(usc.PlanError, match=r"slice.Tensor .* slices the batch dim by a bound the model fixes"):
        usc.lint(PerSample(loss), plan, example_inputs=batch())


class Pairs(Tagger):
    """A preference loss over pairs interleaved in the batch (rows 0/1, 2/3, 4/5: chosen, rejected);
    "sft": plus the chosen rows' cross-entropy, a token mean over the counted tokens (RPO's form)."""

    def forward(self, ids, labels):
        z = self.head(self.emb(ids))
        logp = F.log_softmax(z, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1).sum(-1)  # [B]
        preference = -F.logsigmoid(logp[0::2] - logp[1::2]).mean()
        if self.loss != "sft":
            return preference
        chosen = z[0::2].reshape(-1, VOCAB)
        return preference + F.cross_entropy(chosen, labels[0::2].reshape(-1), ignore_index=IGNORED)


@pytest.mark.parametrize("plan", ["dp=3", "dp=2", "tp=2", "cp=2"])
def test_pairs_interleaved_in_the_batch_equal_one_device(plan):
    """Under dp=3 each rank holds whole pairs, and the strided slices stay local (they gathered the
    batch); under dp=2 a pair straddles two ranks and the batch is gathered, as it must be."""
    result = assert_equivalent(lambda: Pairs("kl_sum").double(), plan, [batch()] * 2, optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10
    gathers = [c for c in usc.lint(Pairs("kl_sum"), plan, example_inputs=batch()).collectives
               if c.axis == "dp" and c.kind == "all-gather"]
    assert bool(gathers) == (plan == "dp=2")


# (plan, rows): a microbatch of one pair (analysed on two), of three pairs, of a pair per dp rank
MICROBATCHED_PAIRS = [("mb=3", 6), ("pp=2 mb=3", 6), ("mb=2", 12), ("dp=3 mb=2", 12), ("dp=2 mb=3", 12)]


@pytest.mark.parametrize("plan, rows", MICROBATCHED_PAIRS)
@pytest.mark.parametrize("loss", ["kl_sum", "sft"])
def test_pairs_interleaved_in_the_batch_run_in_microbatches_that_hold_whole_pairs(loss, plan, rows):
    """The microbatch analysis splits the batch into pieces of whole pairs (it split a microbatch
    sample by sample and refused every plan here); with a token mean beside it, that mean divides
    by the step's count."""
    assert_equivalent(lambda: Pairs(loss).double(), plan, [batch(rows)] * 2, optimizer=sgd,
                      rtol=1e-10, atol=1e-10, param_atol=1e-10)


def test_a_microbatch_that_splits_a_pair_is_refused_saying_so():
    with pytest.raises(usc.PlanError, match=r"pairs samples in groups of 2, and a microbatch of 3 samples does not "
                                            r"hold whole groups"):
        usc.lint(Pairs("kl_sum"), "mb=2", example_inputs=batch())


def test_what_microbatches_cannot_combine_is_refused_by_name():
    """A mean divided by the batch's size (not linear in the microbatches' means). (A token mean beside
    terms weighted otherwise divides by the step's count: test_losses_counted_first.py.)"""

    class MeanOverBatchSize(Tagger):
        def forward(self, ids, labels):
            z = self.head(self.emb(ids))
            return F.cross_entropy(z.reshape(-1, VOCAB), labels.reshape(-1)) / ids.size(0)

    with pytest.raises(usc.PlanError, match="cross_entropy_loss.default .* is scaled by 0.333333, which may be taken "
                                            "from the shape of the microbatch"):
        usc.lint(MeanOverBatchSize("kl_sum"), "dp=3 mb=2", example_inputs=batch())
    assert_equivalent(lambda: MeanOverBatchSize("kl_sum").double(), "dp=2", [batch()] * 2, optimizer=sgd,
                      rtol=1e-10, atol=1e-10, param_atol=1e-10)


class Blocks(nn.Module):
    """Scores reduced inside blocks of samples: "fixed" splits the batch into two blocks whatever its
    size (``reshape(2, -1, d)``), "pairs" into groups of two samples (``view(-1, 2, d)``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.emb, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, 3)

    def forward(self, ids, labels):
        h = self.head(self.emb(ids)).mean(1)  # [B, 3]
        if self.kind == "fixed":
            return h.reshape(2, -1, 3).mean(1).pow(2).sum()
        groups = h.view(-1, 2, 3)
        return (groups[:, 0] - groups[:, 1]).pow(2).mean() + groups.mean(1).pow(2).sum()


@pytest.mark.parametrize("plan", ["mb=2", "mb=3", "mb=6", "dp=3 mb=2", "pp=2 mb=6"])
def test_samples_grouped_by_a_reshape_run_in_microbatches_that_hold_whole_groups(plan):
    assert_equivalent(lambda: Blocks("pairs").double(), plan, [batch(12)] * 2, optimizer=sgd,
                      rtol=1e-10, atol=1e-10, param_atol=1e-10)


@pytest.mark.parametrize("plan", ["mb=2", "mb=3", "mb=6", "pp=2 mb=6"])
def test_a_batch_split_into_a_fixed_number_of_blocks_is_refused_under_microbatches(plan):
    """On a microbatch of 2 (mb=6 of 12) the reshape is [2, 1, 3], one sample a block, and the proof's
    split fell on the blocks: it trained on 35x the loss (mb=6: 1.997 where one device has 0.058),
    silently; at mb=2 and mb=3 too (0.219, 0.506)."""
    with pytest.raises(usc.PlanError, match=r"reshape.default .* splits the batch dim into 2 blocks, whatever the "
                                            r"number of samples"):
        usc.lint(Blocks("fixed"), plan, example_inputs=batch(12))
    assert_equivalent(lambda: Blocks("fixed").double(), "dp=2", [batch(12)] * 2, optimizer=sgd,
                      rtol=1e-10, atol=1e-10, param_atol=1e-10)
