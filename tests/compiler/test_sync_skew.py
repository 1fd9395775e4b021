"""Where ranks share cores, a blocking collective waits for its group to meet (``sync_skew_by_ranks``).

With more ranks than cores the OS runs ranks in turns, so partners finish the same work up to a time
slice apart; calibrate.py measures the wait while every rank computes. Here: the table is read,
checked and interpolated like the profile's other tables; a GPU profile has none and its estimates
do not move; on a profile with one, each blocking layer collective the compiled program issues
(tp/sp, cp) waits once per call and the gradient reduction once per step, and pipeline transfers,
which the shared-core timeline already steps, do not."""

from dataclasses import replace

import pytest
import torch

import usc
from usc.compiler.hardware import H100, HardwareProfileError, hardware_profile
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

CPU = replace(H100, name="cpu-shared", host_cores=2.0, host_launch="sync", comm_overlap=0.0, gpus_per_node=4,
              latency_steps="ring")


def test_the_skew_table_is_read_checked_and_interpolated(tmp_path):
    assert H100.sync_skew_by_ranks == () and H100.skew(8, 1.0) == 0.0  # each GPU rank owns its device
    path = tmp_path / "here.toml"
    path.write_text('base = "h100"\nsync_skew_by_ranks = [[2, 0.001], [4, 0.004]]\nsync_skew_gap = 0.015\n')
    hw = hardware_profile(str(path))
    assert hw.sync_skew_by_ranks == ((2, 0.001), (4, 0.004)) and hw.sync_skew_gap == 0.015
    assert hw.skew(2, 0.015) == pytest.approx(0.001) and hw.skew(4, 0.015) == pytest.approx(0.004)
    assert hw.skew(3, 0.015) == pytest.approx(0.0025)  # linear between group sizes
    assert hw.skew(8, 1.0) == pytest.approx(0.004)  # the ends held beyond them, and above the gap
    assert hw.skew(4, 0.005) == pytest.approx(0.004 / 3)  # a shorter gap waits proportionally less
    assert hw.skew(1, 1.0) == 0.0 and hw.skew(4, 0.0) == 0.0  # a group of one, or no compute between
    assert replace(hw, sync_skew_gap=0.0).skew(4, 1e-6) == pytest.approx(0.004)  # no gap: the table at any
    for text, message in [("[[1, 0.001]]", "group size 1: a whole number of at least 2"),
                          ("[[4, 0.004], [2, 0.001]]", "each group size once, ascending"),
                          ("[[2, -0.001]]", "-0.001 seconds at 2 ranks")]:
        path.write_text(f'base = "h100"\nsync_skew_by_ranks = {text}\n')
        with pytest.raises(HardwareProfileError, match=f"'sync_skew_by_ranks' .*{message}"):
            hardware_profile(str(path))
    path.write_text('base = "h100"\nsync_skew_gap = -1\n')
    with pytest.raises(HardwareProfileError, match="'sync_skew_gap' must be a positive number"):
        hardware_profile(str(path))


@pytest.fixture(scope="module")
def model_and_batch():
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(vocab=1999, hidden=48, heads=4, kv_heads=4, mlp=96, layers=3, max_seq=64))
    return model, token_batch(1999, 12, 24)


def _lint(model_and_batch, plan, hw):
    model, batch = model_and_batch
    return usc.lint(model, plan, example_inputs=batch, hardware=hw)


def _meetings(report, waits: dict) -> float:
    """The waits a step of the compiled program meets, counted from its collective records (not the
    estimate's): each collective node of the graph (tp/sp, cp, the loss's token count; a pipeline's
    transfers aside) once per call in the step, and the gradient reducer's first sum once."""
    graph = [r for r in report.collectives if r.node.startswith("usc_") and r.axis != "pp"]
    reducer = [r for r in report.collectives if r.node == "reducer"]
    ends = waits[reducer[0].group_size] if reducer else 0.0  # tp alone: the graph sums its gradients itself
    return sum(r.calls_per_step * waits[r.group_size] for r in graph) + ends


WAITS = {2: 0.001, 4: 0.003}


@pytest.mark.parametrize("plan, microbatches", [("dp=2 tp=2", 1), ("tp=4", 1), ("dp=2 cp=2", 1), ("dp=2 tp=2 mb=3", 3)])
def test_each_blocking_collective_of_the_program_waits_once(model_and_batch, plan, microbatches):
    """On a table without a gap (the wait at any gap), a step's estimate grows by the wait of its
    group for each blocking collective call of the compiled program and one wait of the gradient
    reduction's group, and only its comm term moves."""
    skewed = replace(CPU, sync_skew_by_ranks=tuple(WAITS.items()), sync_skew_gap=0.0)
    plain, with_wait = _lint(model_and_batch, plan, CPU), _lint(model_and_batch, plan, skewed)
    added = _meetings(with_wait, WAITS)
    assert added > 0.004
    assert with_wait.cost.time["step"] - plain.cost.time["step"] == pytest.approx(added, rel=1e-9)
    assert with_wait.cost.time["exposed_comm"] - plain.cost.time["exposed_comm"] == pytest.approx(added, rel=1e-9)
    assert {k: v for k, v in with_wait.cost.time.items() if k not in ("exposed_comm", "step")} == \
        pytest.approx({k: v for k, v in plain.cost.time.items() if k not in ("exposed_comm", "step")})


def test_pipeline_transfers_do_not_wait_and_a_gpu_profile_does_not_move(model_and_batch):
    """A pipeline's transfers are in the shared-core timeline, which already makes a stage wait for
    its neighbour: ``dp=2 pp=2 mb=2``'s comm term moves by its other meetings only, its transfers' times stay. The
    h100 profile has no table: its estimates are those of a profile without the term."""
    skewed = replace(CPU, sync_skew_by_ranks=tuple(WAITS.items()), sync_skew_gap=0.0)
    plain, with_wait = (_lint(model_and_batch, "dp=2 pp=2 mb=2", hw) for hw in (CPU, skewed))
    # the step is timed on the slowest stage, here the first (the embedding and most layers): it
    # issues no graph collective -- the token count's sums are the loss stage's -- so it waits only at
    # the reducer; the timeline of the stages' costs, the loss stage's waits in them, moves the bubble
    ends, every = WAITS[2], _meetings(with_wait, WAITS)
    assert every > ends
    assert with_wait.cost.time["exposed_comm"] - plain.cost.time["exposed_comm"] == pytest.approx(ends, rel=1e-9)
    assert 0 < with_wait.cost.time["step"] - plain.cost.time["step"] <= every
    pipeline = [(c.calls_per_step, c.exposed_seconds) for c in with_wait.cost.collectives if c.axis == "pp"]
    assert pipeline and pipeline == [(c.calls_per_step, c.exposed_seconds) for c in plain.cost.collectives if c.axis == "pp"]
    for plan in ("dp=2 tp=2", "dp=2 cp=2", "dp=2 pp=2 mb=2"):
        gpu = _lint(model_and_batch, plan, "h100").cost
        table = _lint(model_and_batch, plan, replace(H100, sync_skew_by_ranks=((2, 1.0),), sync_skew_gap=0.0)).cost
        assert gpu.time["step"] < table.time["step"]  # the term would move it, were the table there
        assert gpu.time == _lint(model_and_batch, plan, replace(H100, sync_skew_gap=0.5)).cost.time


def test_a_shorter_gap_between_meetings_waits_less(model_and_batch):
    """The wait grows with the compute between two meetings up to the gap it was measured at: the
    same table read at a gap far above the step's per-call compute adds less than at a gap far below."""
    plain = _lint(model_and_batch, "dp=2 tp=2", CPU).cost.time["step"]
    at = {gap: _lint(model_and_batch, "dp=2 tp=2", replace(CPU, sync_skew_by_ranks=tuple(WAITS.items()), sync_skew_gap=gap))
          .cost.time["step"] - plain for gap in (1e-9, 10.0)}
    assert 0 < at[10.0] < at[1e-9] / 100
