"""The search skips mesh shapes whose step floor is over every plan its answer could show: the floor
is under every plan of its shape, and the answer is the one scoring every shape gives. The support
checks' cache answers as the compiler does for every plan it is asked about."""

from dataclasses import replace

import pytest
import torch

from usc.compiler import planner
from usc.compiler.cost_model import estimate, step_floor
from usc.compiler.hardware import A100, H100
from usc.compiler.planner import RECOMPUTE_ORDER, PlanTarget, search
from usc.planning import refusal
from usc.passes.cost_profile import profile_model
from usc.testing.models import MoEConfig, TinyMixtral, token_batch
from usc.model_call import trainable

VOCAB = 96


def hf_qwen2():
    import transformers

    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=6,
                                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.Qwen2ForCausalLM(config)


@pytest.fixture(scope="module", params=["hf-qwen2", "mixtral"])
def profile(request):
    torch.manual_seed(0)
    if request.param == "hf-qwen2":
        model = trainable(hf_qwen2(), None)
        tokens, labels = token_batch(VOCAB, 6, 12)
        return profile_model(model, model.flatten({"input_ids": tokens, "labels": labels}))
    cfg = MoEConfig(layers=4)
    return profile_model(TinyMixtral(cfg), token_batch(cfg.vocab, 8, 16))


# (GPUs, sequence, global batch, hardware): memory binds on the small device, so ZeRO stages,
# microbatches and recompute all take part; the odd batch leaves shapes whose dp does not divide it
TARGETS = [(64, 48, 96, replace(H100, name="small", hbm_bytes=900_000)),
           (96, 96, 48, replace(A100, name="small-a100", hbm_bytes=2_000_000)),
           (32, 48, 40, H100)]


def _points(base, sizes, target):
    counts = planner._microbatches(target.global_batch // sizes["dp"], sizes["pp"])
    for zero in ((0, 1, 2, 3) if sizes["dp"] > 1 else (0,)):
        for schedule, v in planner._schedules(sizes["pp"]):
            for mb in counts:
                for recompute in RECOMPUTE_ORDER:
                    yield base.with_(zero=zero, schedule=schedule, v=v, mb=mb, recompute=recompute)


@pytest.mark.parametrize("gpus, seq, batch, hw", TARGETS)
def test_the_floor_is_under_every_plan_of_its_shape(profile, gpus, seq, batch, hw):
    target = PlanTarget(gpus=gpus, seq=seq, global_batch=batch, gpus_per_node=8)
    state = planner._Search(profile, target, hw, planner.PlanSearch(target, hw.name, None, []), refusal)
    checked = added = 0
    for sizes, problem in planner.mesh_shapes(profile, target):
        if problem:
            continue
        base = state.base(sizes)
        floor = state.floor(sizes, base)
        ends = state.gradient_floor(sizes, base)  # per ZeRO stage, what the step's end adds
        assert floor > 0 and set(ends) == {p.zero for p in _points(base, sizes, target)}
        for point in _points(base, sizes, target):
            step = estimate(profile, point, hw).time["step"]
            assert step >= (floor + ends[point.zero]) * (1 - 1e-12), (point.text(), step, floor, ends)
            checked += 1
        added += max(ends.values()) > 0
    assert checked > 500
    assert added > 0  # the step's end bounds something (a shape with dp or ZeRO)


def _shown(result) -> str:
    """The answer as printed, without the header's counts and the dropped plans (a skipped shape's
    plans are neither estimated nor dropped one by one)."""
    lines = str(result).split("\n")[1:]
    cut = next((i for i, line in enumerate(lines) if line == "  dropped:"), len(lines))
    return "\n".join(lines[:cut])


@pytest.mark.parametrize("gpus, seq, batch, hw", TARGETS)
def test_skipping_shapes_changes_no_answer(profile, gpus, seq, batch, hw):
    target = PlanTarget(gpus=gpus, seq=seq, global_batch=batch, gpus_per_node=8)
    skipped = search(profile, target, hw, supported=refusal)
    every = search(profile, target, hw, supported=refusal, skip=False)
    assert every.skipped_shapes == 0
    assert (skipped.best and skipped.best.plan) == (every.best and every.best.plan)
    assert [c.plan for c in skipped.alternatives] == [c.plan for c in every.alternatives]
    assert {k: v if isinstance(v, str) else (v.plan, v.step) for k, v in skipped.families.items()} == \
        {k: v if isinstance(v, str) else (v.plan, v.step) for k, v in every.families.items()}
    assert (skipped.best_checked and skipped.best_checked.plan) == (every.best_checked and every.best_checked.plan)
    assert _shown(skipped) == _shown(every)


def test_the_skip_leaves_out_shapes_on_a_cluster():
    """Transformers' Llama at Llama-3-8B's shapes (on the meta device) at 512 GPUs: most mesh shapes
    cannot come near the answer, their floors are over it, and the answer is the full search's."""
    import transformers

    import usc

    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tokens = torch.zeros(8, 4096, dtype=torch.long, device="meta")
    spec = "gpus=512 gpus_per_node=8 seq=4096 global_batch=256 dtype=bf16"
    seen = {}
    real = planner.search

    def both(profile, target, hw, **kw):
        seen["every"] = real(profile, target, hw, skip=False, **kw)
        return real(profile, target, hw, **kw)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("usc.planning.search", both)
        result = usc.plan(model, spec, example_inputs={"input_ids": tokens, "labels": tokens}, hardware="h100").search
    assert result.best is not None and result.skipped_shapes > 40 and result.skipped_zero_stages > 0
    assert f"{result.skipped_shapes} mesh shapes and {result.skipped_zero_stages} ZeRO stages of the others skipped" \
        in str(result).split("\n")[0]
    assert result.best.plan == seen["every"].best.plan and _shown(result) == _shown(seen["every"])


def test_the_support_cache_tells_interleaved_microbatch_groups_apart():
    """An interleaved schedule needs whole groups of pp microbatches: pp=4 with mb=2 is refused and
    pp=2 with mb=2 is not, so the two may not share a cached answer."""
    a = planner.PlanPoint(16, 32, dp=2, pp=4, mb=2, schedule="interleaved", v=2)
    b = planner.PlanPoint(16, 32, dp=4, pp=2, mb=2, schedule="interleaved", v=2)
    assert refusal(a) and refusal(b) is None
    assert planner._support_key(a) != planner._support_key(b)


@pytest.mark.parametrize("gpus, batch", [(32, 16), (64, 24)])
def test_the_search_answers_as_with_every_plan_checked_on_its_own(profile, gpus, batch, monkeypatch):
    """A batch too small for some shapes' pp leaves them fewer microbatches than stages: the search's
    cached support answers are those of checking each plan itself."""
    target = PlanTarget(gpus=gpus, seq=48, global_batch=batch, gpus_per_node=8)
    hw = replace(H100, name="small", hbm_bytes=900_000)
    cached = search(profile, target, hw, supported=refusal)
    monkeypatch.setattr(planner, "_support_key", lambda point: point)
    each = search(profile, target, hw, supported=refusal)
    assert str(cached).split("\n", 1)[1] == str(each).split("\n", 1)[1]
