"""The independent activation counters (usc.testing.memory_counters) against each other and against
what a schedule must hold: the cost model's validation is only as good as they are."""

import torch

import usc
from usc.testing.memory_counters import count_activations, count_peaks
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

CONFIG = LlamaConfig(layers=4)


def _sim(plan: str, batch):
    torch.manual_seed(0)
    sim = usc.simulate(TinyLlama(CONFIG), plan, example_inputs=batch)
    sim.step(*batch)  # counters start after a first step: compiling moves nothing
    return sim


def test_the_whole_step_counter_agrees_with_the_phase_counter_without_a_pipeline():
    """One microbatch, no pipeline: the most alive at once is what is alive when backward begins (or
    while it recomputes); the two counters find it by different means."""
    batch = token_batch(CONFIG.vocab, 8, 32)
    for plan in ("dp=2", "tp=2 recompute=full"):
        sim = _sim(plan, batch)
        phased = max(c.peak_in_backward for c in count_activations(sim, batch))
        whole = max(count_peaks(sim, batch))
        assert abs(whole - phased) <= 0.01 * phased, (plan, whole, phased)


def test_a_pipelines_first_rank_holds_what_its_schedule_keeps_in_flight():
    """GPipe runs every forward before any backward (4 microbatches in flight on the first rank);
    1F1B holds at most pp = 2; the last rank holds one under 1F1B."""
    batch = token_batch(CONFIG.vocab, 8, 32)
    gpipe = count_peaks(_sim("pp=2 mb=4 schedule=gpipe", batch), batch)
    one_f_one_b = count_peaks(_sim("pp=2 mb=4", batch), batch)
    assert gpipe[0] > 1.5 * one_f_one_b[0]
    assert one_f_one_b[1] < one_f_one_b[0]


def test_the_whole_step_counter_keeps_what_an_input_pass_records_and_not_accumulated_gradients():
    """Zero-bubble's passes, by hand: what an input pass makes and still holds when it ends (the
    gradients recorded for the weight pass) is counted though made with grad mode off, its
    transients are not; a weight pass's ``.grad.add_`` (grad mode on) is the parameter's state."""
    from usc.testing.memory_counters import _ComputeSpans, _WholeStepWatch

    param = torch.nn.Parameter(torch.zeros(1000))
    param.grad = torch.zeros(1000)
    spans = _ComputeSpans()
    watch = _WholeStepWatch(set(), spans, [param])
    with watch:
        with spans.span("I0", "compute"), torch.no_grad():
            scratch = torch.ones(5000)  # the pass's working set: gone before it ends
            kept = torch.ones(500) * 2  # recorded for the weight pass
            del scratch
        assert watch.peak == kept.untyped_storage().nbytes() == 2000
        with spans.span("W0", "compute"):
            param.grad.add_(kept.sum())
    del kept
    assert watch.live.total == 0  # the accumulated gradient is not an activation
