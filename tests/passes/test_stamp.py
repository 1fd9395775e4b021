"""Stamped repeated layers (compiler/stamp.py): the same graph, state and lint report as the full trace."""

import dataclasses

import pytest
import torch

from usc.compiler.stamp import graphs_equal, repeated_layers, trace_stamped
from usc.compiler.trace import trace
from usc.linting import lint_plan
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, token_batch

BATCH = token_batch(128, 4, 16)


def llama(layers=5):
    torch.manual_seed(0)
    return TinyLlama(LlamaConfig(layers=layers))


def test_repeated_layers_are_found():
    assert repeated_layers(llama()) == ("layers", 5)
    assert repeated_layers(llama(layers=3)) is None  # too few to be worth it


@pytest.mark.parametrize("model", [llama, lambda: TinyGPT2(dataclasses.replace(GPT2Config(), layers=5))],
                         ids=["llama", "gpt2"])
def test_stamped_trace_is_the_full_trace(model):
    m = model()
    full, stamped = trace(m, BATCH), trace_stamped(m, BATCH)
    assert stamped.stamped, "the layers should have been stamped"
    assert graphs_equal(stamped.gm, full.gm)  # node names, ops, arguments, shapes, module paths
    assert stamped.state == full.state and stamped.module_types == full.module_types
    assert len(stamped.gm.graph.nodes) == len(full.gm.graph.nodes) > 150


@pytest.mark.parametrize("plan", ["dp=2 tp=2", "tp=2 cp=2 sp=on", "dp=2 zero=3", "dp=2 pp=2 mb=2"])
def test_stamped_report_is_the_full_report(plan):
    m = llama()
    full = lint_plan(m, plan, example_inputs=BATCH, stamp=False)
    stamped = lint_plan(m, plan, example_inputs=BATCH, stamp=True)
    assert stamped.traced.stamped and not full.traced.stamped
    a, b = full.report.to_dict(), stamped.report.to_dict()
    a.pop("compile_seconds"), b.pop("compile_seconds")
    assert a == b  # collectives (with node names), memory, activations, findings ...
    assert len(a["collectives"]) >= 5 and (plan.startswith("dp=2 pp") or a["activation_bytes_per_rank"] > 0)


class CountsItsLayers(TinyLlama):
    """A forward that uses the number of layers outside them: stamping two layers would be wrong."""

    def forward(self, tokens, labels):
        return super().forward(tokens, labels) * len(self.layers)


def test_a_model_that_does_not_repeat_linearly_is_traced_whole():
    torch.manual_seed(0)
    m = CountsItsLayers(LlamaConfig(layers=5))
    stamped = trace_stamped(m, BATCH)
    assert not stamped.stamped  # the 2- and 3-layer traces disagree outside the layers: full trace
    assert graphs_equal(stamped.gm, trace(m, BATCH).gm)


@pytest.mark.parametrize("padded", [False, True], ids=["all-ones mask", "padding mask"])
def test_hugging_face_llama_with_a_collator_batch_is_stamped(padded):
    """Hugging Face builds its masks before the layers (index ops on the batch, packed-sequence
    checks): the 2- and 3-layer traces must still agree name for name, or lint traces every layer
    (an 8B model: 4.9 s instead of 1.4 s)."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=98, hidden_size=24, intermediate_size=40, num_hidden_layers=5,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    ids = torch.randint(0, 98, (4, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :2] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids}
    stamped = lint_plan(model, "dp=2 tp=2", example_inputs=batch, stamp=True)
    assert stamped.traced.stamped, "the layers should have been stamped"
    full = lint_plan(model, "dp=2 tp=2", example_inputs=batch, stamp=False)
    a, b = full.report.to_dict(), stamped.report.to_dict()
    a.pop("compile_seconds"), b.pop("compile_seconds")
    assert a == b
