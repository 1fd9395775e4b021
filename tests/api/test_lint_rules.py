"""Every usc-lint rule: a plan that triggers it and one that does not (USC107/108, the whole-mesh order
check, are triggered by corrupted programs in tests/passes/test_mesh_order_check.py)."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from usc.compiler.hardware import H100
from usc.compiler.lint_rules import RULES, explain
from usc.dsl import PlanError, parse_plan
from usc.linting import lint_plan
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama, TorchEncoderLM, token_batch


class TinyMoE(nn.Module):
    """A dense mixture of experts (every expert runs, weighted by the router): traces like Mixtral's."""

    def __init__(self, experts: int, vocab: int = 64, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.router = nn.Linear(hidden, experts)
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(experts))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        weights = self.router(x).softmax(-1)
        y = sum(weights[..., i:i + 1] * expert(x) for i, expert in enumerate(self.experts))
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 8)

    def forward(self, tokens, labels):
        x = self.embed(tokens)
        if x.sum() > 0:  # control flow on a value: the tracer cannot follow it
            x = x * 2
        return x.mean()


def llama(**changes):
    return lambda: TinyLlama(dataclasses.replace(LlamaConfig(), **changes))


def frozen_llama(dtype: torch.dtype):
    """The embedding and first layer frozen, held in ``dtype`` (a fine-tuning setup)."""
    def build():
        model = TinyLlama(LlamaConfig())
        for name, param in model.named_parameters():
            if name.startswith(("embed", "layers.0.")):
                param.requires_grad_(False)
                param.data = param.data.to(dtype)
        return model
    return build


MODELS = {
    "llama": llama(),
    "llama-frozen": frozen_llama(torch.float32),
    "llama-frozen-bf16": frozen_llama(torch.bfloat16),
    "llama-4-layers": llama(layers=4),
    "llama-vocab-130": llama(vocab=130),
    "llama-6-heads": llama(heads=6, kv_heads=2, hidden=96),
    "llama-big-vocab": llama(vocab=512),  # the lm head weighs 0.8 of a layer: pp=2 cannot balance
    "gpt2": lambda: TinyGPT2(GPT2Config()),
    "moe-3": lambda: TinyMoE(3),
    "moe-4": lambda: TinyMoE(4),
    "data-dependent": DataDependent,
    "sequence-first": lambda: TorchEncoderLM(batch_first=False),  # tokens read as [S, B]
}
TINY_DEVICE = dataclasses.replace(H100, name="tiny", hbm_bytes=5 * 10**5)
_traces: dict = {}


def lint(plan: str, model: str = "llama", *, batch=(8, 32), hardware=H100):
    """Lint with one trace per (model, batch, mb): the rules, not the tracer, are under test."""
    torch.manual_seed(0)
    m = MODELS[model]()
    vocab = m.embed.num_embeddings if hasattr(m, "embed") else (
        m.config.vocab if hasattr(m, "config") else 128)
    try:
        key = (model, batch, parse_plan(plan).get("mb"))
    except PlanError:
        key = None
    result = lint_plan(m, plan, example_inputs=token_batch(vocab, *batch), hardware=hardware,
                       traced=_traces.get(key))
    if key is not None and result.traced is not None:
        _traces[key] = result.traced
    return result


def codes(result) -> set[str]:
    return {f.code for f in result.findings}


def finding(result, code):
    return next(f for f in result.findings if f.code == code)


# (code, triggering lint arguments, non-triggering lint arguments)
CASES = [
    ("USC100", ("zero=1",), ("dp=2 zero=1",)),
    ("USC101", ("dp=2", "data-dependent"), ("dp=2",)),
    ("USC102", ("tp=4\nembed_tokens: vocab", "llama-vocab-130"), ("tp=4", "llama-vocab-130")),
    ("USC103", ("cp=4 cp_mode=ulysses",), ("cp=2 cp_mode=ulysses",)),
    ("USC104", ("ep=2", "moe-3"), ("ep=2", "moe-4")),
    ("USC105", ("cp=3",), ("cp=4 cp_mode=zigzag",)),
    ("USC109", ("dp=3",), ("dp=4",)),
    ("USC201", ("tp=4 gpus_per_node=2",), ("tp=4",)),
    ("USC202", ("tp=2\nlayers.*.mlp.gate_proj: rowwise\nlayers.*.mlp.up_proj: rowwise\n"
                "layers.*.mlp.down_proj: colwise",), ("tp=2",)),
    ("USC203", ("tp=4", "llama-6-heads"), ("tp=2", "llama-6-heads")),
    ("USC204", ("tp=4",), ("tp=2",)),
    ("USC205", ("pp=2 mb=2", "llama-big-vocab"), ("pp=2 mb=2", "llama-4-layers")),
    ("USC206", ("pp=2 mb=2",), ("pp=2 mb=4",)),
    ("USC208", ("dp=4",), ("dp=2",)),
    ("USC209", ("tp=2", "gpt2"), ("tp=2",)),
    ("USC210", ("tp=2 cp=2 sp=on",), ("cp=2 tp=2 sp=on",)),
    ("USC211", ("dp=2", "sequence-first"), ("dp=2",)),
    ("USC301", ("dp=2 bucket_mb=0.01",), ("dp=2",)),
    ("USC302", ("tp=2",), ("dp=2",)),
    ("USC303", ("dp=2 dtype=bf16", "llama-frozen"), ("dp=2 dtype=bf16", "llama-frozen-bf16")),
]


@pytest.mark.parametrize("code, hit, miss", CASES, ids=[c[0] for c in CASES])
def test_rule_triggers_and_does_not(code, hit, miss):
    assert code in codes(lint(*hit)), f"{code} should fire for {hit}"
    assert code not in codes(lint(*miss)), f"{code} should not fire for {miss}"


def test_every_rule_has_a_case():
    covered = {c[0] for c in CASES} | {"USC106", "USC107", "USC108", "USC207"}  # tested below / in passes
    assert covered == set(RULES)


def test_out_of_memory_names_the_largest_term():
    # 90,432 float32 weights (embedding + head 2 x 8,192, 2 layers x 36,992, norm 64) = 353.2 KiB;
    # AdamW keeps two of them: 706.5 KiB, larger than the weights, gradients or 2 x 8 tokens' activations
    result = lint("dp=1", batch=(2, 8), hardware=TINY_DEVICE)
    f = finding(result, "USC106")
    assert f.severity == "error" and "does not fit the tiny's 488.3 KiB" in f.message
    assert "the largest term is optimizer state (706.5 KiB)" in f.message and result.exit_code() == 1
    assert "USC106" not in codes(lint("dp=1"))  # the H100's 80 GB


def test_zero3_over_more_than_512_ranks():
    assert "USC207" in codes(lint("dp=1024 zero=3", batch=(1024, 4)))
    assert "USC207" not in codes(lint("dp=512 zero=3", batch=(1024, 4)))


def test_messages_point_at_the_plan_item():
    result = lint("dp=2\ntp=4 gpus_per_node=2")
    f = finding(result, "USC201")
    assert result.location(f) == (2, 1)
    assert f.message == "each tp group spans 2 nodes: tp=4 > gpus_per_node=2"
    # tp written outside dp: each tp group strides over dp and spans nodes although tp fits one
    inner = finding(lint("tp=2 dp=4 gpus_per_node=4"), "USC201")
    assert "the axes inside tp (dp) spread each tp group over 2 nodes" in inner.message


def test_pipeline_findings_say_what_to_change():
    bubble = finding(lint("pp=2 mb=2"), "USC206")
    # 8 rows: mb=3 would not divide them
    assert "idles 33% of the step" in bubble.message and bubble.hint.startswith("mb=4 brings it to 20%")
    # 10 rows over dp=2: mb=2 leaves 5 rows a microbatch, which dp cannot split, and 3 does not
    # divide 10 -- the hint names the first count the batch allows
    bubble = finding(lint("dp=2 pp=2", batch=(10, 32)), "USC206")
    assert "idles 50% of the step" in bubble.message and bubble.hint.startswith("mb=5 brings it to 17%")
    imbalance = finding(lint("pp=2 mb=2", "llama-big-vocab"), "USC205")
    assert imbalance.message.startswith("pipeline stage 1 has ")


def test_errors_before_compiling_are_all_reported_at_once():
    result = lint("dp=3 cp=3")
    assert {"USC105", "USC109"} <= codes(result) and result.report is None and result.exit_code() == 1


def test_exit_code_is_strict_about_warnings():
    result = lint("tp=4")  # USC204 warning only
    assert result.counts()["error"] == 0 and result.counts()["warning"] >= 1
    assert result.exit_code() == 0 and result.exit_code(strict=True) == 1


def test_report_warnings_map_onto_codes():
    for plan, model in (("tp=2", "gpt2"), ("tp=2 cp=2 sp=on", "llama"), ("tp=4", "llama")):
        result = lint(plan, model)
        assert result.report.warnings
        for warning in result.report.warnings:
            module = warning.split(":")[0]
            block = re.sub(r"\.\d+(?=\.|$)", ".*", module).rsplit(".", 1)[0]
            assert any(block in f.message or (f.code == "USC210" and module.startswith("tp is outside cp"))
                       for f in result.findings), f"report warning without a code: {warning}"


def test_explain_every_code_and_a_near_miss():
    for code in RULES:
        text = explain(code)
        assert text.startswith(f"{code} ({RULES[code].name}) [{RULES[code].severity}]") and len(text) > 150
    with pytest.raises(KeyError, match="did you mean USC201"):
        explain("USC2001")


def test_heads_tp_does_not_split_say_the_estimate_counts_them_split():
    """USC204 on usc's Llama (2 key/value heads) at tp=4: the program keeps attention whole, so its
    only tp all-reduces are the MLPs'; the cost estimate, profiled at tp=2 where attention splits,
    counts attention's too -- the finding says so, and the counts show it."""
    import usc

    assert "the cost estimate, profiled at tp=2 where they split, counts their work and all-reduces " \
           "split tp ways" in finding(lint("tp=4"), "USC204").message
    torch.manual_seed(0)
    model = MODELS["llama"]()
    report = usc.lint(model, "tp=4", example_inputs=token_batch(model.config.vocab, 8, 32), hardware="h100")
    graph = sum(r.calls_per_step for r in report.collectives if r.axis == "tp" and r.node.startswith("usc_"))
    estimated = sum(c.calls_per_step for c in report.cost.collectives if c.axis == "tp" and c.bytes_per_step > 8)
    assert 0 < graph < estimated
