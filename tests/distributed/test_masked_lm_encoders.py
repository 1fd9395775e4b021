"""Masked-LM encoders in three other styles than BERT's, as transformers builds them, fed a padded
masked-LM batch (about 30% of the tokens labelled, the rest -100): ALBERT (one layer's weights shared
by every layer, a factorised embedding), DistilBERT, RoBERTa (positions offset past the padding id).
Equal to one device under every axis that splits the batch or the sequence and under tp and pp
(float64, SGD, 1e-10). Under pp, ALBERT's shared layer is one module, so all its iterations run on
one stage (the pipeline cuts between modules); its decoder weight, tied to the embedding on the other
stage, has its gradient summed over pp."""

import pytest
import torch

from usc.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

VOCAB = 98


def albert():
    return transformers.AlbertForMaskedLM(transformers.AlbertConfig(
        vocab_size=VOCAB, embedding_size=16, hidden_size=24, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=40, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout_prob=0.0))


def distilbert():
    return transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=24, n_layers=2, n_heads=4, hidden_dim=40, max_position_embeddings=32, dropout=0.0,
        attention_dropout=0.0))


def roberta():
    return transformers.RobertaForMaskedLM(transformers.RobertaConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, intermediate_size=40,
        max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=1))


def batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (6, 8), generator=g)
    ids[2, 6:] = 1  # padding
    labels = torch.where(torch.rand(6, 8, generator=g) < 0.3, ids, torch.full_like(ids, -100))
    labels[0, 0] = ids[0, 0]
    return {"input_ids": ids, "attention_mask": (ids != 1).long(), "labels": labels}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", ["dp=2", "dp=3 mb=2", "tp=2", "pp=2 mb=2", "cp=2"])
@pytest.mark.parametrize("family", [albert, distilbert, roberta], ids=["albert", "distilbert", "roberta"])
def test_masked_lm_encoders_equal_one_device(family, plan):
    result = assert_equivalent(lambda: family().double(), plan, [batch(s) for s in range(2)], optimizer=sgd,
                               rtol=1e-10, atol=1e-10, param_atol=1e-10)
    assert result.max_param_diff <= 1e-10
