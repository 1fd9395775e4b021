"""Models built on torch's own sequence modules, written as torch's examples write them.

- A causal LM on ``nn.TransformerEncoder`` with its mask made in forward and no ``is_causal``: torch
  compares the mask's values with a causal mask to pick a fast path (``_detect_is_causal_mask``),
  which export cannot trace; every such model failed to trace. Traced with the mask kept (usc's
  attention-mask pass proves it causal), it trains like one device under every plan.
- A sequence-first model (``[S, B]`` inputs, as torch's word_language_model feeds them): usc splits
  dim 0 as the batch. Under dp that dim is split and its attention runs as a ring over dp (the same
  numbers); microbatches would each attend within their own slice -- a different model, which ran
  with no error. Now refused, naming the attention and saying to feed the model batch-first.
- An RNN op's dropout: ``aten.lstm`` is tagged as drawing random numbers for its dropout between
  layers; with ``dropout=0`` (or one layer, or eval) it draws nothing, and usc said it did.
"""

import pytest
import torch
from torch import nn

import usc
from usc.passes.random_ops import is_random
from usc.testing import assert_equivalent
from usc.testing.models import TorchEncoderLM

FLOAT64 = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), rtol=1e-10, atol=1e-10, param_atol=1e-10)
VOCAB, WIDTH, BATCH = 39, 15, 6


def causal_lm():
    """torch's encoder as a decoder-only LM: the mask built in forward, no is_causal hint."""
    return TorchEncoderLM(VOCAB, WIDTH, 3, 22, causal=True)


def seq_first_lm():
    """torch's encoder sequence-first, inputs [S, B] (torch's default layout)."""
    return TorchEncoderLM(VOCAB, WIDTH, 3, 22, batch_first=False)


class Seq2Seq(nn.Module):
    """torch's nn.Transformer (encoder-decoder) as its docs use it: the target mask made in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.transformer = nn.Transformer(WIDTH, 3, 2, 2, 22, dropout=0.0, batch_first=True)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, source, target_in, target_out):
        mask = nn.Transformer.generate_square_subsequent_mask(target_in.shape[1], dtype=self.head.weight.dtype)
        hidden = self.transformer(self.embed(source), self.embed(target_in), tgt_mask=mask)
        return nn.functional.cross_entropy(self.head(hidden).flatten(0, 1), target_out.flatten())


class SequenceFirstPositions(nn.Module):
    """A sequence-first model with positions and no attention across them: a table sliced by the
    inputs' dim 0 (``table``) or learned positions looked up by an arange (``learned``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.register_buffer("table", torch.randn(16, 1, WIDTH))
        self.positions = nn.Embedding(16, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 22), nn.GELU(), nn.Linear(22, VOCAB))

    def forward(self, tokens, labels):
        seq = tokens.shape[0]
        if self.kind == "filled":  # made like the table, one value throughout: rows alike
            where = torch.full_like(self.table[:seq], 0.5)
        else:
            where = self.table[:seq] if self.kind == "table" else self.positions(torch.arange(seq)).unsqueeze(1)
        logits = self.mlp(self.embed(tokens) + where)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def make(cls):
    def build():
        torch.manual_seed(0)
        return cls().double()
    return build


def batches(seq: int, n: int = 2, *, sequence_first: bool = False):
    g = torch.Generator().manual_seed(3)
    shape = (seq, BATCH) if sequence_first else (BATCH, seq)
    return [(torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g))
            for _ in range(n)]


@pytest.mark.parametrize("plan", ["dp=2", "mb=2", "dp=3 mb=2", "tp=3", "pp=2 mb=2", "cp=2", "cp=2 cp_mode=zigzag"])
def test_a_causal_lm_on_torch_encoder_with_its_mask_made_in_forward_trains_like_one_device(plan):
    seq = 8 if "cp" in plan else 7
    assert_equivalent(make(causal_lm), plan, batches(seq), **FLOAT64)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor:UserWarning")  # torch's, on nn.Transformer's encoder
@pytest.mark.parametrize("plan", ["dp=2", "mb=2", "dp=3 mb=2", "tp=3", "pp=2 mb=2"])
def test_torch_transformer_encoder_decoder_trains_like_one_device(plan):
    """Its decoder checks the target mask's values as the encoder does: it did not trace either."""
    g = torch.Generator().manual_seed(4)
    batch = [(torch.randint(0, VOCAB, (BATCH, 9), generator=g), torch.randint(0, VOCAB, (BATCH, 7), generator=g),
              torch.randint(0, VOCAB, (BATCH, 7), generator=g)) for _ in range(2)]
    assert_equivalent(make(Seq2Seq), plan, batch, **FLOAT64)


def test_the_mask_made_in_forward_becomes_is_causal():
    """Kept through the trace, then proven causal: no mask tensor reaches attention."""
    sim = usc.simulate(make(causal_lm)(), "tp=3", example_inputs=batches(7, 1)[0])
    attention = [n for n in sim.program.gm.graph.nodes
                 if n.op == "call_function" and "scaled_dot_product" in str(n.target)]
    assert attention and all(n.kwargs.get("is_causal") or (len(n.args) > 5 and n.args[5]) for n in attention)


def test_a_sequence_first_model_trains_like_one_device_under_dp():
    """dp splits dim 0, the sequence here: the attention runs as a ring over dp, the same numbers."""
    assert_equivalent(make(seq_first_lm), "dp=2", batches(8, sequence_first=True), **FLOAT64)


@pytest.mark.parametrize("plan", ["mb=2", "dp=2 mb=2", "pp=2 mb=2"])
def test_a_sequence_first_model_is_refused_under_microbatches(plan):
    with pytest.raises(usc.PlanError, match=r"(?s)attention in module 'encoder.layers.0.self_attn'.*dim 0.*"
                                            r"sequence-first.*batch-first"):
        usc.simulate(make(seq_first_lm)(), plan, example_inputs=batches(8, 1, sequence_first=True)[0])


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's, on nn.LSTM(dropout=, num_layers=1) and its export
@pytest.mark.parametrize("layers, dropout, train, draws", [(2, 0.0, True, False), (1, 0.3, True, False),
                                                            (2, 0.3, False, False), (2, 0.3, True, True)])
def test_an_rnn_draws_only_with_dropout_between_layers_in_training(layers, dropout, train, draws):
    lstm = nn.LSTM(5, 6, layers, dropout=dropout, batch_first=True).train(train)
    gm = torch.export.export(lstm, (torch.randn(2, 3, 5),), strict=False).graph_module
    nodes = [n for n in gm.graph.nodes if n.op == "call_function" and "lstm" in str(n.target)]
    assert nodes and [is_random(n) for n in nodes] == [draws]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's export, on nn.LSTM's flat weights
def test_an_lstm_without_dropout_is_refused_for_what_it_lacks_not_for_drawing():
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.rnn, self.head = nn.Embedding(VOCAB, 8), nn.LSTM(8, 8, 2, batch_first=True), nn.Linear(8, 3)

        def forward(self, tokens, labels):
            return nn.functional.cross_entropy(self.head(self.rnn(self.embed(tokens))[0]).flatten(0, 1),
                                               labels.flatten() % 3)

    with pytest.raises(usc.CompileError, match="no sharding rule for aten.lstm.input") as info:
        usc.simulate(Tagger(), "dp=2", example_inputs=batches(7, 1)[0])
    assert "random" not in str(info.value)


def test_the_planner_does_not_split_a_sequence_as_the_batch():
    """usc.plan's estimates read dim 0 as the batch; a sequence-first model's dp would be a ring it does
    not count, its microbatches are refused: refused unless dp and mb are written as 1."""
    tokens = batches(8, 1, sequence_first=True)[0]
    with pytest.raises(usc.CompileError, match=r"(?s)'encoder.layers.0.self_attn' attends across it.*batch-first"):
        usc.plan(seq_first_lm(), "gpus=4", example_inputs=tokens)
    chosen = usc.plan(seq_first_lm(), "gpus=1 dp=1 mb=1", example_inputs=tokens)
    assert chosen.size("dp") == 1 and int(chosen.get("mb")) == 1
    assert usc.plan(causal_lm(), "gpus=4", example_inputs=batches(8, 1)[0]).world_size == 4


@pytest.mark.parametrize("kind", ["table", "learned"])
def test_positions_along_a_sequence_split_as_the_batch_are_refused_under_microbatches(kind):
    """Each microbatch's program takes the first positions of the table, not its own: refused (it ran,
    a different model), naming the add; under dp the table is sliced per rank, the same numbers."""
    build = lambda: SequenceFirstPositions(kind).double()  # noqa: E731
    data = batches(8, 2, sequence_first=True)
    with pytest.raises(usc.PlanError, match=r"(?s)mb=2 runs the batch in microbatches.*rows of a table or of positions"):
        usc.simulate(build(), "mb=2", example_inputs=data[0])
    assert_equivalent(build, "dp=2", data, **FLOAT64)


def test_a_value_made_like_a_table_but_filled_alike_trains_under_microbatches():
    """full_like of the table's slice: every row the same, so microbatches compute the one-device model."""
    assert_equivalent(lambda: SequenceFirstPositions("filled").double(), "mb=2",
                      batches(8, 2, sequence_first=True), **FLOAT64)
