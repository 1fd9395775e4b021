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


def time_stepped_bubble(name: str, pp: int, mb: int, ranks: int, cores: float) -> float:
    schedule = build_schedule(name, pp, 1, mb)
    programs = {r: [a for a in acts if isinstance(a, Compute)] for r, acts in schedule.actions.items()}
    cost = {ComputeOp.FORWARD: 1.0, ComputeOp.BACKWARD: 2.0}
    position, left, finished, now = {r: 0 for r in programs}, {}, set(), 0.0
    while any(position[r] < len(p) for r, p in programs.items()):
        ready = [r for r, p in programs.items()
                 if position[r] < len(p) and all(e in finished for e in requires(schedule, p[position[r]]))]
        # k busy stages stand for k * ranks / pp busy processes on `cores` cores, at most one core each
        busy_processes = len(ready) * ranks / pp
        speed = min(1.0, cores / busy_processes) * ranks / cores if ranks > cores else 1.0
        for r in ready:
            act = programs[r][position[r]]
            left.setdefault(r, cost[act.op])
            left[r] -= speed * DT
            if left[r] <= 1e-9:
                finished.update(produces(act))
                position[r] += 1
                del left[r]
        now += DT
    return now / 3.0 - mb


CASES = [("1f1b", 4, 4), ("1f1b", 2, 4), ("1f1b", 4, 8), ("1f1b", 3, 5), ("gpipe", 4, 4), ("gpipe", 3, 5),
         ("1f1b", 5, 3)]


# (ranks, cores) of a node holding whole pipelines: ranks a multiple of pp
SHARING = [(pp * k, cores) for pp in (2, 3, 4, 5) for k, cores in ((1, 2), (2, 3), (1, pp))]


@pytest.mark.parametrize("name, pp, mb, ranks, cores",
                         [(n, p, m, r, c) for n, p, m in CASES for r, c in SHARING if r % p == 0])
def test_bubble_matches_a_time_stepped_run_of_the_runtime_schedules(name, pp, mb, ranks, cores):
    expected = time_stepped_bubble(name, pp, mb, ranks, cores)
    assert shared_bubble_units(name, pp, mb, ranks, cores) == pytest.approx(expected, abs=4 * DT * mb * pp)


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
