"""Models users bring: Hugging Face families built from config objects (random weights, odd sizes,
nothing downloaded) and models written here in the styles of torchtitan and nanoGPT, passed to usc
as their users hold them -- the model object itself and its batches (a collator's dict, nanoGPT's
``(idx, targets)``, torchtitan's ``(tokens, labels)`` with ``loss_fn=``) -- and trained on simulated
meshes against one device.

Every case ends one of two ways: it equals one device (judged as ``users_tier.judge`` says), or usc
refuses with a usc error that names what is missing (``KNOWN_REFUSALS``, each with the words the
error must contain).

By default the most used families (``NAMED``) run one plan each (rotating through
``dp=2 tp=2``, ``pp=2 mb=2`` and ``EXTRA_PLANS``; MoE families rotate through ``MOE_PLANS``), to stay
cheap in CI; ``USC_DEEP_TIER=1`` runs every family under every plan of
``DENSE_PLANS``, cp, and ``MOE_PLANS`` for MoE families, printing each outcome (``-s``).
"""

from __future__ import annotations

import os
import re

import pytest
import torch

import usc
from usc.testing import assert_equivalent

pytest.importorskip("transformers")

from users_models import BATCH, FAMILIES, HF_DECODERS, MOE_FAMILIES, batches, build  # noqa: E402
from users_tier import judge  # noqa: E402

DENSE_PLANS = ("dp=2 tp=2", "pp=2 mb=2", "dp=2 zero=3 fuse=on")
# The default rotation: odd dp, tp alone, and ZeRO-3 without fusion (fused kernels run under
# Triton's interpreter on CPU, a minute or two per case: fuse=on stays in the deep tier).
EXTRA_PLANS = ("dp=3", "tp=2", "dp=2 zero=3")
MOE_PLANS = ("dp=2 ep=2", "dp=2 ep=2 tp=2")
CP_PLAN = "cp=2"
DEEP = os.environ.get("USC_DEEP_TIER") == "1"

# (family, plan) -> words the refusal must contain: cases usc refuses today, by name.
KNOWN_REFUSALS: dict[tuple[str, str], str] = {}
# cp on a build without attention masks under cp refuses Hugging Face models by this message.
CP_MASK = "context parallelism supports scaled_dot_product_attention without an explicit mask"
# family -> words of a refusal under every plan (none today: PhiMoE's sparsemixer router, which samples
# its experts with ``exponential_`` while training, draws through usc's counter-based exponential).
FAMILY_REFUSALS: dict[str, str] = {}


# The most used families: the default run's share of the tier.
NAMED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "phi3", "olmo2", "gpt_neox", "falcon", "stablelm",
         "bloom", "bert_mlm", "vit", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss",
         "torchtitan_llama", "nanogpt")


def plans_of(family: str) -> tuple[str, ...]:
    return DENSE_PLANS + (MOE_PLANS if family in MOE_FAMILIES else ())


def _cases():
    rotation = DENSE_PLANS[:2] + EXTRA_PLANS
    for i, family in enumerate(FAMILIES if DEEP else NAMED):
        chosen = plans_of(family) if DEEP else \
            (MOE_PLANS[i % 2] if family in MOE_FAMILIES else rotation[i % len(rotation)],)
        for plan in chosen:
            yield pytest.param(family, plan, id=f"{family}-{plan.replace(' ', '-')}")


def _judged(family: str, plan: str):
    refusal = KNOWN_REFUSALS.get((family, plan)) or FAMILY_REFUSALS.get(family)
    if refusal is None:
        outcome = judge(family, plan)
        print(f"TIER {outcome}")
        return outcome
    with pytest.raises((usc.CompileError, usc.PlanError), match=refusal) as refused:
        judge(family, plan)
    print(f"TIER {family} [{plan}]: refused: {str(refused.value).splitlines()[0]}")
    return None


@pytest.mark.parametrize("family, plan", list(_cases()))
def test_family_trains_like_one_device(family, plan):
    _judged(family, plan)


def cp_refusal(family: str) -> str:
    """The words a cp=2 refusal of the family must contain."""
    if family in FAMILY_REFUSALS:
        return FAMILY_REFUSALS[family]
    if family == "vit":  # dim 1 of pixel_values is its 3 channels: there is no sequence to split
        return "cp=2 needs the sequence of input .* to divide into 2 pieces"
    return CP_MASK if family in HF_DECODERS or family == "bert_mlm" else "(a model usc must not refuse)"


@pytest.mark.parametrize("family", list(FAMILIES) if DEEP else ["llama", "torchtitan_llama", "nanogpt"])
def test_context_parallel_equals_one_device_or_names_the_mask(family):
    """cp=2 equals one device, or is refused by name: ViT (dim 1 of its pixels is channels, no
    sequence), PhiMoE (its random router), and -- where attention masks under cp are not in the
    build -- Hugging Face models, which pass an explicit mask."""
    try:
        outcome = judge(family, CP_PLAN)
    except (usc.CompileError, usc.PlanError) as err:
        assert re.search(cp_refusal(family), str(err)), err
        print(f"TIER {family} [{CP_PLAN}]: refused: {str(err).splitlines()[0]}")
        return
    print(f"TIER {outcome}")


def padded_batch(family: str, seed: int) -> dict:
    """A collator's padded batch: a row left-padded by 3, another right-padded by 2, labels -100 there."""
    batch = FAMILIES[family].batch(seed, BATCH)
    mask = batch["attention_mask"]
    mask[1, :3] = 0
    mask[4, -2:] = 0
    batch["labels"][mask == 0] = -100
    return batch


DENSE_HF = [name for name in HF_DECODERS if name not in MOE_FAMILIES]
PADDED_CI = ("llama", "gpt2", "bloom", "falcon", "gemma2")


@pytest.mark.parametrize("plan", ["dp=2", "pp=2 mb=2"])
@pytest.mark.parametrize("family", DENSE_HF if DEEP else PADDED_CI)
def test_padded_batches_train_like_one_device(family, plan):
    """Every dense Hugging Face decoder builds its padding mask by indexing it with an arange over the
    whole batch; before that read as batch-local, dp gathered the mask and microbatches refused it
    (measured: all 24 dense decoders equal under both plans, SGD, parameters within 1.2e-7)."""
    result = assert_equivalent(FAMILIES[family].build, plan, [padded_batch(family, s) for s in range(2)],
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert result.max_param_diff <= 1e-6


def test_the_tier_has_the_families_the_issue_names():
    hf = [f for f in FAMILIES if f not in ("torchtitan_llama", "nanogpt")]
    assert set(NAMED) <= set(FAMILIES) and len(hf) >= 20 and len(MOE_FAMILIES) >= 5


def test_models_are_the_users_own_objects():
    """No wrapper: each family builds the library's own class (or the one written in that style)."""
    for name in ("llama", "bert_mlm", "vit", "mixtral"):
        assert type(build(name)).__module__.startswith("transformers.models."), name
    assert type(build("nanogpt")).__name__ == "NanoGPT" and FAMILIES["torchtitan_llama"].loss_fn is not None


def test_deepseek_v3_under_tp_equals_one_device_step_by_step():
    """DeepSeek-V3 (sigmoid router, 2 groups of which 1 is kept, a shared expert) under tp=2 for four
    AdamW steps: every step's loss within float32 rounding of one device and finite. Its routing has no
    near-ties to flip here: the smallest margin between the kept group and the other is 4.5e-5 over
    these steps, where the router's inputs differ between plans by float32 rounding (~1e-7)."""
    from users_models import FAMILIES
    from users_tier import user_loss

    fam, data = FAMILIES["deepseek_v3"], batches("deepseek_v3", 4)
    torch.manual_seed(0)
    model = fam.build()
    opt, expected = torch.optim.AdamW(model.parameters()), []
    for batch in data:
        loss = user_loss(fam, model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected.append(loss.item())
    torch.manual_seed(0)
    sim = usc.simulate(fam.build(), "tp=2", example_inputs=data[0], optimizer=torch.optim.AdamW)
    got = [sim.step(b) for b in data]
    assert all(abs(a - b) <= 3e-7 * abs(b) for a, b in zip(got, expected)), (got, expected)


def test_moe_experts_that_refuse_float64_are_refused_with_their_own_error():
    """HF's grouped-mm experts refuse float64 weights: usc names that error instead of claiming the
    experts compute no form it knows."""
    from usc.compiler.moe import MoEPatternError, find_blocks

    with pytest.raises(MoEPatternError, match="its own forward fails on a probe of its float64 weights .*Double"):
        find_blocks(build("mixtral").double())


# ---------------------------------------------------------------- ops models bring

class OpZoo(torch.nn.Module):
    """One of each op ordinary models bring, on a batch-sharded input: rms_norm, flatten/unflatten,
    index.Tensor, baddbmm/addmm/einsum, conv1d/2d, scatter/scatter_/index_add, complex RoPE ops."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv1d(3, 5, 3)
        self.conv2 = torch.nn.Conv2d(3, 5, 3)
        self.norm = torch.nn.RMSNorm(25)
        self.w = torch.nn.Parameter(torch.randn(25, 7) / 10)
        self.b = torch.nn.Parameter(torch.randn(7) / 10)

    def forward(self, x, img):
        h = self.norm(self.conv1(x).flatten(1))                                       # [B, 25]
        h = torch.addmm(self.b, h, self.w)                                            # [B, 7]
        h = h + torch.einsum("bi,ij->bj", h, self.w[:7, :7])
        h = torch.baddbmm(h.unsqueeze(1), h.unsqueeze(1), self.w[:7, :7].expand(h.shape[0], 7, 7)).squeeze(1)
        h = h.unflatten(1, (7, 1)).flatten(1)
        h = h[:, torch.tensor([0, 2, 4, 6])]                                          # index.Tensor
        idx = torch.tensor([[1, 0, 3, 2]]).expand(h.shape[0], 4)
        h = torch.scatter(h, 1, idx, h * 2) + torch.zeros_like(h).scatter_(1, idx, h)
        h = h.index_add(1, torch.tensor([0, 0, 1, 3]), h)
        rot = torch.polar(torch.ones(2), torch.tensor([0.3, 1.1]))
        c = torch.view_as_real(torch.view_as_complex(h.view(h.shape[0], 2, 2)) * rot).flatten(1)
        return c.pow(2).mean() + self.conv2(img).pow(2).mean()


def _op_zoo_batch(seed: int, batch: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, 7, generator=g), torch.randn(batch, 3, 5, 5, generator=g)


@pytest.mark.parametrize("plan", ["dp=2", "dp=3"])
def test_the_issues_ops_train_batch_sharded(plan):
    report = usc.lint(OpZoo(), plan, example_inputs=_op_zoo_batch(0))
    assert not [c for c in report.collectives if c.kind == "all-gather" and c.direction == "forward"]
    result = assert_equivalent(OpZoo, plan, [_op_zoo_batch(s) for s in range(3)],
                               optimizer=lambda p: torch.optim.SGD(p, lr=0.01))
    assert result.max_param_diff <= 1e-6 and all(loss < 100 for loss in result.reference_losses)


@pytest.mark.skipif(not DEEP, reason="one lint per family: the deep tier (USC_DEEP_TIER=1)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_op_keeps_the_batch_shard(family):
    """dp=2 compiles with no dp gather in forward: every op ran on its batch slice (the trace-only
    check of every op's rule is tests/compiler/test_op_coverage.py)."""
    fam = FAMILIES[family]
    report = usc.lint(fam.build(), "dp=2", example_inputs=batches(family, 1)[0], loss_fn=fam.loss_fn)
    gathers = [c for c in report.collectives if c.kind == "all-gather" and c.axis == "dp" and c.direction == "forward"]
    assert not gathers, [f"{c.module}: {c.reason}" for c in gathers]


# ---------------------------------------------------------------- GPT-2's Conv1D

def test_gpt2_conv1d_layers_are_found_as_megatron_pairs():
    report = usc.lint(build("gpt2"), "tp=2", example_inputs=batches("gpt2", 1)[0])
    styles = {c.module: c.style for c in report.tp_choices}
    layer = "transformer.h.0."
    assert [styles[layer + m] for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")] == \
        ["colwise", "rowwise", "colwise", "rowwise"]
    assert report.count("all-reduce", axis="tp", direction="forward", module_prefix=layer) == 2


def test_gpt2_conv1d_pairs_with_sequence_parallel_train_like_one_device():
    print(f"TIER {judge('gpt2', 'dp=2 tp=2 sp=on')}")


# ---------------------------------------------------------------- the report names the link

def test_the_report_says_which_link_placed_each_op():
    fam = FAMILIES["torchtitan_llama"]
    report = usc.lint(fam.build(), "dp=2 tp=2", example_inputs=batches("torchtitan_llama", 1)[0], loss_fn=fam.loss_fn)
    assert report.op_rules["aten.linear.default"] == "hand rule"
    assert report.op_rules["aten.rms_norm.default"] == "decomposition"
    assert report.op_rules["aten.view_as_complex.default"] == "DTensor strategy"
    assert "aten.rms_norm.default (decomposition)" in str(report)


def test_nanogpt_pipeline_report_counts_bool_tensors():
    """forward returns (logits, loss); the pipeline's report sizes every tensor it sends, bools too."""
    report = usc.lint(build("nanogpt"), "pp=2 mb=2", example_inputs=batches("nanogpt", 1)[0])
    assert report.stages
