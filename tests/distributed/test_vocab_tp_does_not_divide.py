"""A vocabulary tp does not divide (GPT-2's 50257 rows, here 1001 = 7 x 11 x 13): automatic tp keeps
the token embedding and the lm head whole on every tp rank, as it keeps any layer whose split dim tp
does not divide, and splits the rest; usc-lint says what that costs and how to pad. A plan rule that
asks to split such a vocabulary is refused, naming the rule, and a tp that splits nothing at all is
refused, naming the first layer it could not split. Hugging Face models as users call them (a
collator's dict, no wrapper), equal to one device under SGD."""

import pytest
import torch

import usc
from usc.dsl import PlanError
from usc.testing import assert_equivalent

transformers = pytest.importorskip("transformers")

VOCAB = 1001  # odd: no tp > 1 that a node holds divides it


def gpt2():  # ties the lm head to the token embedding
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=24, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def llama():  # a head of its own
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))


FAMILIES = {"gpt2": (gpt2, "transformer.wte", "lm_head"), "llama": (llama, "model.embed_tokens", "lm_head")}


def collated(seed: int, rows: int = 4, seq: int = 6) -> dict:
    ids = torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


@pytest.mark.parametrize("plan", ["tp=2", "dp=2 tp=2 sp=on", "tp=2 pp=2 mb=2"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_vocabulary_tp_does_not_divide_stays_whole_and_trains_like_one_device(name, plan):
    result = assert_equivalent(FAMILIES[name][0], plan, [collated(s) for s in range(2)], optimizer=sgd)
    assert result.max_param_diff <= 1e-6


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_report_keeps_the_vocabulary_whole_splits_the_layers_and_lint_says_how_to_pad(name):
    build, embedding, head = FAMILIES[name]
    report = usc.lint(build(), "tp=2", example_inputs=collated(0))
    styles = {c.module: c.style for c in report.tp_choices}
    assert styles[embedding] == styles[head] == "replicate"
    assert styles["model.layers.0.mlp.down_proj" if name == "llama" else "transformer.h.0.mlp.c_proj"] == "rowwise"
    found = [f for f in report.findings if f.code == "USC209" and f.module == embedding]
    assert len(found) == 1 and "size 1001" in found[0].message
    assert "resize_token_embeddings(1001, pad_to_multiple_of=128)" in found[0].hint
    assert not any(f.severity == "error" for f in report.findings)


def test_a_rule_that_splits_the_vocabulary_is_refused_naming_the_rule():
    with pytest.raises(PlanError, match="does not divide dim 0 \\(size 1001\\).*for vocab") as caught:
        usc.lint(llama(), "tp=2\nmodel.embed_tokens: vocab", example_inputs=collated(0))
    assert caught.value.line == 2


def test_a_tp_that_splits_no_layer_is_refused_naming_one():
    """hidden 24, ffn 40, 4 heads, vocab 1001: tp=9 divides none of them."""
    with pytest.raises(PlanError, match="tp=9 cannot split any layer of this model: '.*' kept replicated"):
        usc.lint(llama(), "tp=9", example_inputs=collated(0))


@pytest.mark.parametrize("text", ["tp=2", "dp=2 tp=2 sp=on"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_planner_counts_the_whole_vocabulary_as_the_runtime_holds_and_computes_it(name, text):
    """usc.plan prices tp for such a model (its tp probe compiled nothing before, so no tp plan was
    considered): the weights a rank holds and the products it runs, as the cost model counts them,
    against the compiled program's placements and FlopCounterMode on rank 0's forward."""
    from torch.utils.flop_counter import FlopCounterMode

    from usc.compiler.cost_model import _params, merged_stages, stage_flops_by_kind
    from usc.compiler.trace import trace
    from usc.model_call import trainable
    from usc.passes import parallelize
    from usc.passes.cost_profile import profile_model
    from usc.planning import point_of
    from usc.runtime.executor import fake_rank_zero
    from usc.runtime.sizes import shape_bytes

    torch.manual_seed(0)
    model = trainable(FAMILIES[name][0](), None)
    batch = tuple(model.flatten(collated(0)))
    traced, profile = trace(model, batch), profile_model(model, batch)
    assert profile.tp_divides and profile.tp_divides % 2 == 0
    plan = usc.parse_plan(text)
    point = point_of(plan, global_batch=4, seq=6)
    program = parallelize(traced, plan)
    held = sum(shape_bytes(s.layout.local_shape(s.global_shape, program.mesh), s.dtype)
               for s in program.state if s.kind == "param" and s.trainable)
    (stage,) = merged_stages(profile, 1, None)  # one stage: a tied weight counted once
    assert _params(stage, point) == held
    with fake_rank_zero(program) as (rank, inputs):
        with FlopCounterMode(display=False) as counter:
            rank._loss(rank._split(inputs)[0])
    products = sum(n for op, n in counter.get_flop_counts()["Global"].items()
                   if op in (torch.ops.aten.mm, torch.ops.aten.addmm))
    predicted, _ = stage_flops_by_kind(profile, point, [stage])
    assert predicted == products
