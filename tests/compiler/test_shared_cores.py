"""The pipeline bubble on a host whose ranks share fewer cores, against the runtime's own schedules.

The cost model's simulation (compiler/shared_cores.py) writes 1F1B and GPipe out itself and steps
from event to event. The reference here takes the stage programs and dependencies from the
runtime's schedule builder and checker (passes/pipeline_schedule*.py) and advances time in small
fixed steps: another writing of the schedules and another algorithm, which agree only if both read
processor sharing the same way."""

import pytest

from usc.compiler.cost_model import PlanPoint, bubble_units, pipeline_bubble_units
from usc.compiler.hardware import H100, HardwareProfile
from usc.compiler.shared_cores import shared_bubble_units
from usc.passes.pipeline_schedule import Compute, ComputeOp, build_schedule
from usc.passes.pipeline_schedule_check import check_schedule, produces, requires

DT = 1 / 512


def time_stepped_bubble(name: str, pp: int, mb: int, ranks: int, cores: float, costs=None, unit: float = 3.0) -> float:
    schedule = build_schedule(name, pp, 1, mb)
    programs = {r: [a for a in acts if isinstance(a, Compute)] for r, acts in schedule.actions.items()}
    costs = costs or [(1.0, 2.0)] * pp
    stage_of = {r: next(a.stage for a in p) for r, p in programs.items()}
    position, left, finished, now = {r: 0 for r in programs}, {}, set(), 0.0
    while any(position[r] < len(p) for r, p in programs.items()):
        ready = [r for r, p in programs.items()
                 if position[r] < len(p) and all(e in finished for e in requires(schedule, p[position[r]]))]
        # k busy stages stand for k * ranks / pp busy processes on `cores` cores, at most one core each
        busy_processes = len(ready) * ranks / pp
        speed = min(1.0, cores / busy_processes) * ranks / cores if ranks > cores else 1.0
        for r in ready:
            act = programs[r][position[r]]
            left.setdefault(r, costs[stage_of[r]][act.op is ComputeOp.BACKWARD])
            left[r] -= speed * DT
            if left[r] <= 1e-9:
                finished.update(produces(act))
                position[r] += 1
                del left[r]
        now += DT
    return now / unit - mb


CASES = [("1f1b", 4, 4), ("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 3, 5), ("gpipe", 4, 4), ("gpipe", 3, 5),
         ("1f1b", 5, 3)]


# (ranks, cores) of a node holding whole pipelines: ranks a multiple of pp
SHARING = [(pp * k, cores) for pp in (2, 3, 4, 5) for k, cores in ((1, 2), (2, 3), (1, pp))]


@pytest.mark.parametrize("name, pp, mb, ranks, cores",
                         [(n, p, m, r, c) for n, p, m in CASES for r, c in SHARING if r % p == 0])
def test_bubble_matches_a_time_stepped_run_of_the_runtime_schedules(name, pp, mb, ranks, cores):
    expected = time_stepped_bubble(name, pp, mb, ranks, cores)
    assert shared_bubble_units(name, pp, mb, ranks, cores) == pytest.approx(expected, abs=4 * DT * mb * pp)


# stages of unequal cost (a last stage with the head and the loss, a light first one); the bubble is
# counted in units of the last stage's forward + backward
UNEQUAL = [((1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (1.5, 2.5)), ((0.4, 0.8), (1.0, 2.0), (1.0, 2.0), (1.0, 2.0)),
           ((1.0, 2.0), (2.0, 3.0))]


@pytest.mark.parametrize("name, mb, costs, ranks, cores",
                         [(n, m, c, r, k) for n in ("1f1b", "gpipe") for m in (3, 4) for c in UNEQUAL
                          for r, k in ((len(c), 2), (2 * len(c), 3), (len(c), len(c)))])
def test_unequal_stages_match_a_time_stepped_run_of_the_runtime_schedules(name, mb, costs, ranks, cores):
    """Where a light stage idles, its core speeds the heavy ones: the simulation with each stage's own
    cost against the time-stepped reference, and with a core per rank the timeline a GPU would run."""
    pp, unit = len(costs), sum(costs[-1])
    expected = time_stepped_bubble(name, pp, mb, ranks, cores, costs, unit)
    got = shared_bubble_units(name, pp, mb, ranks, cores, costs, unit)
    assert got == pytest.approx(expected, abs=4 * DT * mb * pp * max(map(sum, costs)) / unit)
    assert got >= mb / max(1.0, ranks / cores) - mb - 1e-9  # the last stage's work at a core at most


def test_a_heavier_last_stage_costs_a_pipeline_less_where_ranks_share_cores():
    """On 4 ranks over 2 cores the other stages' idle time goes to the heavier last stage: the
    timeline's end is under the same stages counted as four copies of the last one, and over what the
    last stage's work takes on a core of its own."""
    light, heavy = (1.0, 2.0), (1.4, 2.6)
    mixed = shared_bubble_units("1f1b", 4, 4, 4, 2, (light, light, light, heavy), 4.0)
    alike = shared_bubble_units("1f1b", 4, 4, 4, 2, (heavy,) * 4, 4.0)
    assert 4 / 2 - 4 < mixed < alike


@pytest.mark.parametrize("name, pp, mb", CASES)
def test_own_cores_give_the_schedule_checkers_bubble(name, pp, mb):
    """A core per rank: the bubble is the GPU one, (p - 1) microbatch times, as the checker measures."""
    costs = {ComputeOp.FORWARD: 1.0, ComputeOp.BACKWARD: 2.0}
    metrics = check_schedule(build_schedule(name, pp, 1, mb), costs=costs)
    assert shared_bubble_units(name, pp, mb, 4, 4) == pytest.approx(metrics.bubble_ratio * mb, rel=1e-9)
    assert shared_bubble_units(name, pp, mb, 4, 4) == pytest.approx(pp - 1, rel=1e-9)


def test_sharing_shrinks_the_bubble_and_never_below_zero():
    for cores in (4, 3, 2, 1):
        values = [shared_bubble_units("1f1b", 4, mb, 4, cores) for mb in (4, 8)]
        assert all(0 <= v <= 3 for v in values)
    assert (shared_bubble_units("1f1b", 4, 4, 4, 1) <= shared_bubble_units("1f1b", 4, 4, 4, 2)
            <= shared_bubble_units("1f1b", 4, 4, 4, 3) <= shared_bubble_units("1f1b", 4, 4, 4, 4))
    # a hand-worked case: two stages, one microbatch, 4 processes on 2 cores. Alone, a stage's rank
    # runs at twice its contended rate: F 0.5, F 0.5, B 1, B 1 = 3 units, one microbatch's work
    assert shared_bubble_units("gpipe", 2, 1, 4, 2) == pytest.approx(0.0, abs=1e-12)


def test_the_time_model_uses_it_only_where_ranks_share_cores():
    point = PlanPoint(8, 128, pp=4, mb=4, gpus_per_node=4)
    assert pipeline_bubble_units(point, H100) == bubble_units(point) == 3.0  # GPUs: host_cores = 0
    cpu = HardwareProfile(**{**H100.to_dict(), "name": "cpu", "host_cores": 2.0})
    assert pipeline_bubble_units(point, cpu) == pytest.approx(shared_bubble_units("1f1b", 4, 4, 4, 2.0))
    assert pipeline_bubble_units(point, cpu) < 3.0
    roomy = HardwareProfile(**{**H100.to_dict(), "name": "cpu", "host_cores": 16.0})
    assert pipeline_bubble_units(point, roomy) == 3.0  # a core per rank
    interleaved = PlanPoint(8, 128, pp=4, mb=4, v=2, schedule="interleaved", gpus_per_node=4)
    # not simulated: the GPU bubble
    assert pipeline_bubble_units(interleaved, cpu) == bubble_units(interleaved)


def test_a_kinds_factor_scales_only_that_kind():
    """A profile's *_factor fields (gloo's all-gather measured ~3x its ring formula) reach the
    collectives' times through the link, and only for their kind."""
    from usc.compiler.cost_model import _link, collective_seconds

    gloo = HardwareProfile(**{**H100.to_dict(), "name": "gloo", "all_gather_factor": 3.0,
                              "reduce_scatter_factor": 1.5})
    assert gloo.collective_factors == (("all-gather", 3.0), ("reduce-scatter", 1.5))
    assert H100.collective_factors == ()
    point = PlanPoint(8, 128, dp=4, gpus_per_node=4)
    plain, scaled = _link(H100, point, "dp"), _link(gloo, point, "dp")
    for kind, factor in (("all-gather", 3.0), ("reduce-scatter", 1.5), ("all-reduce", 1.0),
                         ("send/recv", 1.0)):
        expected = factor * collective_seconds(kind, 5e6, 4, *plain)
        assert collective_seconds(kind, 5e6, 4, *scaled) == pytest.approx(expected)


def test_the_time_model_runs_each_stage_at_its_own_cost_where_ranks_share_cores(monkeypatch):
    """A Llama cut into 4 unequal stages (one of two layers; the head alone), `pp=4 mb=4` on 4 ranks over 2
    cores: the step is the timeline of each stage at its own cost -- under the same stages counted
    as copies of the heaviest, and over both things no timeline beats (the heaviest stage's work at
    a core of its own; all stages' work on every rank's contended share at once)."""
    import torch

    from usc.compiler import cost_model
    from usc.passes.cost_profile import profile_model
    from usc.testing.models import LlamaConfig, TinyLlama, token_batch

    torch.manual_seed(0)
    profile = profile_model(TinyLlama(LlamaConfig(vocab=1999, hidden=48, heads=4, kv_heads=2, mlp=96, layers=4,
                                                  max_seq=64)), token_batch(1999, 4, 24))
    # no per-layer host time: the stage with the most FLOPs, which the estimate counts on, is the slowest
    cpu = HardwareProfile(**{**H100.to_dict(), "name": "cpu", "host_cores": 2.0, "host_launch": "sync",
                             "unit_overhead": 0.0})
    point = PlanPoint(64, 2048, pp=4, mb=4, gpus_per_node=4)
    stages = cost_model.merged_stages(profile, point.pp, point.split)
    costs = cost_model._stage_costs(profile, point, stages, cpu)
    per_stage = [f + b for f, b in costs]
    assert max(per_stage) > 1.2 * min(per_stage)  # unequal stages
    k = cost_model._busiest(profile, point, stages)  # the stage the estimate counts on
    assert per_stage[k] == max(per_stage)
    step = cost_model.estimate(profile, point, cpu).time["step"]
    rest = sum(v for k, v in cost_model.estimate(profile, point, cpu).time.items() if k not in ("compute", "bubble", "step"))
    transfers = point.mb * sum(c.exposed_seconds for c in cost_model._stage_microbatch_collectives(profile, point, k, cpu))
    line = step - rest + transfers  # the pipeline's timeline (its transfers are the comm term's)
    # against the time-stepped run of the runtime's 1F1B with the stages' costs (not the simulation used)
    most = max(per_stage)  # the reference steps time in 1/512 of a unit: costs in units of the slowest stage
    scaled = [(f / most, b / most) for f, b in costs]
    reference = (point.mb + time_stepped_bubble("1f1b", 4, 4, 4, 2.0, scaled, 1.0)) * most
    assert line == pytest.approx(reference, abs=4 * DT * point.mb * 4 * most)
    assert line > point.mb * max(per_stage) / 2 and line >= point.mb * sum(per_stage) / 4
    monkeypatch.setattr(cost_model, "_shared_stage_costs", lambda *a: None)  # every stage as the heaviest
    assert cost_model.estimate(profile, point, cpu).time["step"] > step


def test_a_pipeline_is_timed_on_its_slowest_stage_not_the_one_with_most_flops(monkeypatch):
    """A small Llama with a wide vocabulary, cut in four: the head's stage has the most FLOPs, but at
    the h100 profile's per-layer host time a stage of more layers takes longer a microbatch. The
    estimate times the step on the slowest stage (each stage's forward, backward and collectives
    from ``_microbatch_passes``), and counted on the FLOPs' choice instead it is faster."""
    import torch

    from usc.compiler import cost_model
    from usc.passes.cost_profile import profile_model
    from usc.testing.models import LlamaConfig, TinyLlama, token_batch

    torch.manual_seed(0)
    profile = profile_model(TinyLlama(LlamaConfig(vocab=7001, hidden=256, heads=4, kv_heads=2, mlp=512, layers=6,
                                                  max_seq=64)), token_batch(7001, 4, 24))
    point = PlanPoint(4, 24, pp=4, mb=4, gpus_per_node=8)
    stages = cost_model.merged_stages(profile, point.pp, point.split)
    times = []
    for k in range(len(stages)):
        _, forward, backward, _, comms, _, _ = cost_model._microbatch_passes(profile, point, stages, k, H100)
        times.append(forward + backward + sum(c.exposed_seconds for c in comms))
    busiest = cost_model._busiest(profile, point, stages)
    slowest = cost_model._slowest(profile, point, stages, cost_model._stage_costs(profile, point, stages, H100))
    assert slowest == times.index(max(times)) != busiest and times[slowest] > 3 * times[busiest]
    step = cost_model.estimate(profile, point, H100).time["step"]
    monkeypatch.setattr(cost_model, "_slowest", lambda profile, plan, stages, costs: busiest)  # the FLOPs' choice
    assert cost_model.estimate(profile, point, H100).time["step"] < step
