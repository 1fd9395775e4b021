"""Sequence classifiers as transformers builds them, fed a padded collator's batch: BERT (pooler,
classifier) and GPT-2 (the last real token's logits, picked as ``logits[arange(B), last]``), each for
single-label classification (cross-entropy), multi-label classification (BCE with logits on
``[B, labels]`` targets) and regression (MSE on ``logits.squeeze()``). Equal to one device under
every axis that splits the batch or the sequence, microbatches included (float64, SGD, 1e-10).

Before: GPT-2's ``logits[arange(B), last]`` and the regression head's ``squeeze()`` (a one-row
slice per rank loses its batch dim) needed the whole batch, so microbatches refused them; cp split
the multi-label targets' dim 1 as if it were the sequence and refused 5 labels."""

import pytest
import torch

from usc.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

VOCAB, LABELS = 98, 5
PROBLEMS = {"single_label_classification": LABELS, "multi_label_classification": LABELS, "regression": 1}


def bert(problem):
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=32, num_labels=PROBLEMS[problem], problem_type=problem, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


def gpt2(problem):
    return transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=32, num_labels=PROBLEMS[problem],
        problem_type=problem, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0))


def batch(problem: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (6, 8), generator=g)
    ids[1, 6:] = 0  # right padding (pad id 0): GPT-2 pools the last real token
    ids[3, 5:] = 0
    labels = {"single_label_classification": lambda: torch.randint(0, LABELS, (6,), generator=g),
              "multi_label_classification": lambda: (torch.rand(6, LABELS, generator=g) > 0.5).double(),
              "regression": lambda: torch.randn(6, generator=g, dtype=torch.float64)}[problem]()
    return {"input_ids": ids, "attention_mask": (ids != 0).long(), "labels": labels}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", ["dp=2", "dp=3 mb=2", "tp=2", "pp=2 mb=2", "cp=2"])
@pytest.mark.parametrize("problem", sorted(PROBLEMS))
@pytest.mark.parametrize("family", [bert, gpt2], ids=["bert", "gpt2"])
def test_sequence_classifiers_equal_one_device(family, problem, plan):
    result = assert_equivalent(lambda: family(problem).double(), plan, [batch(problem, s) for s in range(2)],
                               optimizer=sgd, rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10
