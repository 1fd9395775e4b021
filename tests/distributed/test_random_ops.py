"""Random ops have defined semantics: a draw is a function of (seed, step, global element index).

Replicas draw identical values (tp), shards draw their slice of what one device draws (dp, sp,
microbatches), recompute draws the same numbers again, and every plan equals usc's own one-device run with
the same seed (README, "What equal means")."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import usc
from usc.passes.random_ops import DRAW_DTYPE
from usc.runtime.random import draw_values, global_index, op_key
from usc.testing import assert_equivalent
from usc.testing.equivalence import usc_reference_run

transformers = pytest.importorskip("transformers")

SGD = dict(optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
FLOAT64 = dict(rtol=1e-10, atol=1e-12, param_atol=1e-10, reference="usc", **SGD)


# ------------------------------------------------------------------ the generator itself

def test_a_microbatch_draws_its_rows_of_the_full_batch_draw():
    key = op_key(7, 3, 1)
    full = draw_values(global_index((6, 5, 3), None, 0, 1, "cpu"), key, torch.float64, "uniform", 0.0, 1.0)
    for m in range(3):
        piece = draw_values(global_index((2, 5, 3), 0, m, 3, "cpu"), key, torch.float64, "uniform", 0.0, 1.0)
        assert torch.equal(piece, full[2 * m: 2 * m + 2])


def test_a_microbatch_of_a_flattened_tensor_draws_its_rows():
    """[B*S, H] with the batch outermost: microbatch m's rows follow m*b*S in the full tensor."""
    key = op_key(0, 0, 4)
    full = draw_values(global_index((12, 3), None, 0, 1, "cpu"), key, torch.float32, "keep", 0.3, 0.0)
    piece = draw_values(global_index((4, 3), 0, 2, 3, "cpu"), key, torch.float32, "keep", 0.3, 0.0)
    assert torch.equal(piece, full[8:12])


def test_draws_are_uniform_and_keep_masks_drop_p():
    index = global_index((200, 501), None, 0, 1, "cpu")
    u = draw_values(index, op_key(1, 0, 0), torch.float32, "uniform", 0.0, 1.0)
    keep = draw_values(index, op_key(1, 0, 0), torch.float64, "keep", 0.1, 0.0)
    normal = draw_values(index, op_key(1, 0, 1), torch.float64, "normal", 0.0, 1.0)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
    sigma = (0.1 * 0.9 / index.numel()) ** 0.5  # of the dropped fraction; bounds below are 5 sigma
    assert abs(float(u.double().mean()) - 0.5) < 5 * (1 / 12 / index.numel()) ** 0.5
    assert abs(float((keep == 0).double().mean()) - 0.1) < 5 * sigma
    assert set(keep.unique().tolist()) == {0.0, 1.0 / 0.9}
    assert abs(float(normal.mean())) < 1e-2 and abs(float(normal.std()) - 1.0) < 1e-2


def test_exponential_draws_have_the_rate_asked_for():
    index = global_index((200, 501), None, 0, 1, "cpu")
    e = draw_values(index, op_key(1, 0, 2), torch.float64, "exponential", 2.0, 0.0)
    assert float(e.min()) >= 0.0 and bool(torch.isfinite(e).all())
    n = index.numel()  # mean 1/rate and P(e > 1) = exp(-rate), each to 5 sigma
    assert abs(float(e.mean()) - 0.5) < 5 * 0.5 / n ** 0.5
    tail = math.exp(-2.0)
    assert abs(float((e > 1.0).double().mean()) - tail) < 5 * (tail * (1 - tail) / n) ** 0.5


def test_keys_differ_by_seed_step_and_op():
    keys = {op_key(s, t, o) for s in range(3) for t in range(3) for o in range(3)}
    assert len(keys) == 27


def test_a_mask_is_the_same_bits_in_float32_and_float64():
    index = global_index((33, 7), None, 0, 1, "cpu")
    a = draw_values(index, op_key(5, 1, 2), torch.float32, "keep", 0.25, 0.0) != 0
    b = draw_values(index, op_key(5, 1, 2), torch.float64, "keep", 0.25, 0.0) != 0
    assert torch.equal(a, b)


# ------------------------------------------------------------------ programs with dropout

def gpt2():
    """Hugging Face GPT-2 with its default-style dropout (0.1 on residuals, embeddings and attention
    probabilities), eager attention so attention dropout is an nn.Dropout."""
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=48, n_layer=2, n_head=4, n_positions=32,
                                  attn_implementation="eager", resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                                  bos_token_id=0, eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    return LossOf(transformers.GPT2LMHeadModel(cfg)).double()


class LossOf(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids, labels):
        """The causal-LM loss in the model's dtype (Hugging Face's own loss upcasts to float32)."""
        logits = self.m(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def batches(n: int, batch: int = 4, seq: int = 10):
    out = []
    for seed in range(n):
        ids = torch.randint(0, 96, (batch, seq), generator=torch.Generator().manual_seed(seed))
        out.append((ids, ids))
    return out


@pytest.mark.parametrize("plan", ["tp=2", "dp=2 tp=2", "pp=2 mb=2", "dp=2 mb=2", "dp=2 tp=2 pp=2 mb=2"])
def test_gpt2_with_dropout_equals_usc_one_device(plan):
    assert_equivalent(gpt2, plan, batches(3), **FLOAT64)


def test_gpt2_dropout_keeps_tensor_parallel_replicas_identical():
    """The symptom dropout under tp had: replicated LayerNorm weights diverged between the two tp ranks."""
    sim = usc.simulate(gpt2(), "tp=2", example_inputs=batches(1)[0], **SGD)
    for b in batches(3):
        sim.step(*b)
    a, b = sim.rank_state(0), sim.rank_state(1)
    for name in ("m.transformer.h.0.ln_1.weight", "m.transformer.h.1.ln_2.bias", "m.transformer.ln_f.weight"):
        assert torch.equal(a[name], b[name]), name


def test_dropout_is_on_and_the_seed_chooses_the_masks():
    one = usc_reference_run(gpt2(), batches(1), SGD["optimizer"], seed=0)[0]
    same = usc_reference_run(gpt2(), batches(1), SGD["optimizer"], seed=0)[0]
    other = usc_reference_run(gpt2(), batches(1), SGD["optimizer"], seed=1)[0]
    model = gpt2()
    model.eval()
    with torch.no_grad():
        off = float(model(*batches(1)[0]))
    assert one == same and one != other and one[0] != off


class Noisy(nn.Module):
    """Dropout, bernoulli gates and router-style noise (uniform jitter, normal, Gumbel-style exponential)
    in forward, over a batch of odd size."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(23, 12)
        self.up = nn.Linear(12, 18)
        self.gate = nn.Linear(12, 5)
        self.down = nn.Linear(18, 23)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        x = x * torch.empty_like(x).uniform_(0.9, 1.1)  # router noise, as Switch Transformers jitter
        h = F.dropout(torch.relu(self.up(x)), 0.3)
        h = h * torch.bernoulli(torch.full_like(h, 0.8))
        noise = torch.randn_like(self.gate(x)) * 0.1 - torch.empty_like(x[..., :5]).exponential_(2.0).log() * 0.05
        h = h + (self.gate(x) + noise).sum(-1, keepdim=True)
        return F.cross_entropy(self.down(h).flatten(0, 1), labels.flatten())


def noisy():
    torch.manual_seed(0)
    return Noisy().double()


def noisy_batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 23, (6, 7), generator=g), torch.randint(0, 23, (6, 7), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("plan", ["dp=2", "mb=3", "pp=2 mb=2", "dp=3 mb=2"])
def test_random_ops_of_every_kind_equal_usc_one_device(plan):
    assert_equivalent(noisy, plan, noisy_batches(2), **FLOAT64)


@pytest.mark.parametrize("plan", ["pp=2 mb=2 recompute=full", "recompute=selective", "dp=2 recompute=full"])
def test_recompute_draws_the_same_numbers_again(plan):
    """A recomputed region draws again from the key its forward made and kept: the same numbers."""
    assert_equivalent(noisy, plan, noisy_batches(2), **FLOAT64)


@pytest.mark.parametrize("plan", ["pp=2 mb=4 recompute=full", "pp=2 mb=2 recompute=selective",
                                  "dp=2 mb=2 recompute=full", "pp=2 v=2 mb=4 schedule=interleaved recompute=full"])
def test_a_pipelines_recomputed_dropout_uses_its_own_microbatchs_key(plan):
    """Under a pipeline the next microbatch's forward runs before this one's backward: a key made
    again in backward would read the next microbatch's and draw other masks. transformers' GPT-2
    (dropout 0.1 everywhere, the attention's inside scaled_dot_product_attention)."""
    assert_equivalent(gpt2_sdpa, plan, batches(2), **FLOAT64)


class Permuted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(x[:, torch.randperm(6)]).pow(2).mean()


def test_a_random_op_without_a_counter_form_is_refused():
    with pytest.raises(usc.CompileError, match=r"(?s)randperm.*draws random numbers.*fix"):
        usc.simulate(Permuted(), "dp=2", example_inputs=(torch.randn(4, 6),))


def gpt2_sdpa():
    """Hugging Face GPT-2 as its config builds it: scaled_dot_product_attention with dropout 0.1."""
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=48, n_layer=2, n_head=4, n_positions=32,
                                  attn_implementation="sdpa", bos_token_id=0, eos_token_id=0, use_cache=False)
    assert cfg.attn_pdrop == 0.1
    torch.manual_seed(0)
    return LossOf(transformers.GPT2LMHeadModel(cfg)).double()


@pytest.mark.parametrize("plan", ["tp=2", "dp=2 mb=2", "pp=2 mb=2", "cp=2"])
def test_fused_attention_dropout_draws_counter_based(plan):
    """The fused kernel's dropout draws from torch's generator: usc writes that attention out as its
    math with a counter-based mask on the attention weights, so every plan equals usc's one device."""
    assert_equivalent(gpt2_sdpa, plan, batches(2), **FLOAT64)


@pytest.mark.parametrize("plan", ["dp=2 tp=2 sp=on mb=2", "cp=2 tp=2 sp=on", "dp=2 cp=2 recompute=full"])
def test_dropout_drawn_by_sequence_shards_equals_usc_one_device(plan):
    """sp and cp split the residual stream's sequence: each rank draws its positions of the masks."""
    assert_equivalent(gpt2_sdpa, plan, batches(2, seq=12), **FLOAT64)


def test_fused_attention_dropout_is_on():
    one = usc_reference_run(gpt2_sdpa(), batches(1), SGD["optimizer"], seed=0)[0]
    other = usc_reference_run(gpt2_sdpa(), batches(1), SGD["optimizer"], seed=1)[0]
    assert one != other


def test_fused_attention_dropout_is_the_eager_attention_with_the_same_draws():
    """Written out, the fused attention is the model's own eager attention: same weights, same draws
    (the random ops come in the same order), the same losses to float64 rounding."""
    fused = usc_reference_run(gpt2_sdpa(), batches(2), SGD["optimizer"], seed=0)[0]
    eager = usc_reference_run(gpt2(), batches(2), SGD["optimizer"], seed=0)[0]
    assert fused == pytest.approx(eager, rel=1e-12)


def bert():
    """Hugging Face BERT as its config builds it: attention dropout 0.1 in scaled_dot_product_attention
    with a padding mask (not causal)."""
    cfg = transformers.BertConfig(vocab_size=98, hidden_size=24, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=40, max_position_embeddings=32)
    assert cfg.attention_probs_dropout_prob == 0.1
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg).double()


def masked_lm_batch(seed: int) -> dict:
    ids = torch.randint(0, 98, (4, 8), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, ::2] = -100
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("plan", ["dp=2", "tp=2", "pp=2 mb=2"])
def test_bert_with_its_default_dropout_equals_usc_one_device(plan):
    assert_equivalent(bert, plan, [masked_lm_batch(s) for s in range(2)], **FLOAT64)


class _EncoderWithDropout(nn.Module):
    """torch's encoder layer with its default-style dropout (attention weights, both residual
    branches, the feed-forward), batch first, odd sizes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 15)
        layer = nn.TransformerEncoderLayer(15, 3, dim_feedforward=22, dropout=0.2, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(15, 1)

    def forward(self, x, y):
        return (self.head(self.encoder(self.embed(x))).squeeze(-1) - y).pow(2).mean()


def _bf16_and_float32_losses(factory, plan: str, batch) -> tuple[list, list, object]:
    """Three SGD steps of ``plan`` and of the same plan without dtype=bf16 (same seed: same masks)."""
    runs = []
    for dtype_plan in (plan, plan.replace("dtype=bf16", "").strip() or "dp=1"):
        torch.manual_seed(0)
        sim = usc.simulate(factory(), dtype_plan, example_inputs=batch,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
        runs.append(([sim.step(batch) if isinstance(batch, dict) else sim.step(*batch) for _ in range(3)], sim))
    (bf16, sim), (fp32, _) = runs
    return bf16, fp32, sim


def _within_bf16_rounding(bf16, fp32) -> bool:
    from usc.testing.equivalence import BF16_U

    return bf16 != fp32 and all(abs(a - b) <= (i + 1) * 2 * BF16_U * abs(b) for i, (a, b) in enumerate(zip(bf16, fp32)))


@pytest.mark.parametrize("plan", ["dtype=bf16", "dp=3 mb=2 dtype=bf16"])
def test_dropout_masks_are_drawn_in_the_compute_dtype(plan):
    """Under dtype=bf16 a float32 mask lifted each dropped activation to float32, and the attention's
    next matmul failed ("expected scalar type Float but found BFloat16"). The masks are drawn in the
    dtype of the tensor they drop from, and the bf16 run stays within bf16 rounding of the float32
    run of the same plan (same seed: the same masks, compared on 32 bits whatever the dtype)."""
    g = torch.Generator().manual_seed(5)
    batch = (torch.randn(6, 7, 4, generator=g), torch.randn(6, 7, generator=g))
    bf16, fp32, sim = _bf16_and_float32_losses(_EncoderWithDropout, plan, batch)
    draws = [n for n in sim.program.gm.graph.nodes if n.target is torch.ops.usc.draw.default]
    assert len(draws) == 8 and all(n.args[DRAW_DTYPE] == torch.bfloat16 for n in draws)
    assert _within_bf16_rounding(bf16, fp32), (bf16, fp32)


@pytest.mark.parametrize("plan", ["dtype=bf16", "dp=2 dtype=bf16"])
def test_bert_with_its_default_dropout_trains_in_bf16(plan):
    """transformers' BERT (dropout 0.1 everywhere) failed under any dtype=bf16 plan ("mat1 and mat2
    must have the same dtype, but got Float and BFloat16")."""
    bf16, fp32, _ = _bf16_and_float32_losses(lambda: bert().float(), plan, masked_lm_batch(0))
    assert _within_bf16_rounding(bf16, fp32), (bf16, fp32)
