"""Pipeline schedules as data: text round trips, generator outputs written as strings, the checker on
every generated schedule and on broken ones, metrics against the bubble formulas, the picture."""

from __future__ import annotations

import textwrap
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st
from usc.passes.pipeline_schedule import (
    PEER_OFFSET,
    Comm,
    CommOp,
    Compute,
    ComputeOp,
    Schedule,
    build_schedule,
    lower_communication,
    parse_action,
    parse_schedule,
)
from usc.passes.pipeline_schedule_check import ScheduleError, check_schedule, render_timeline, simulate


def schedule(text: str) -> Schedule:
    return parse_schedule(textwrap.dedent(text))


def exact(x: float) -> Fraction:
    return Fraction(x).limit_denominator(10_000)


# --- text form -----------------------------------------------------------------------------------

computes = st.builds(Compute, st.integers(0, 99), st.sampled_from(ComputeOp), st.integers(0, 99))


@st.composite
def comms(draw):
    op = draw(st.sampled_from(CommOp))
    stage = draw(st.integers(max(0, -PEER_OFFSET[op]), 99))
    return Comm(stage, op, draw(st.integers(0, 99)), stage + PEER_OFFSET[op])


@given(st.one_of(computes, comms()))
def test_action_text_round_trips(action):
    assert parse_action(str(action)) == action
    assert repr(action) == str(action)


def test_action_text_examples():
    assert parse_action("2F0") == Compute(2, ComputeOp.FORWARD, 0)
    assert parse_action("0W12") == Compute(0, ComputeOp.WEIGHT_GRAD, 12)
    assert parse_action("0SF3>1") == Comm(0, CommOp.SEND_F, 3, 1)
    assert parse_action("1RB3<2").matching() == parse_action("2SB3>1")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2X0", "not a pipeline action"),
        ("0SF0<1", "needs a peer written >STAGE"),
        ("0F0>1", "takes no peer"),
        ("0SF0>2", "talks to stage 1"),
        ("1RB0<0", "talks to stage 2"),
        ("F0", "not a pipeline action"),
    ],
)
def test_bad_action_text_is_refused(text, message):
    with pytest.raises(ValueError, match=message):
        parse_action(text)


GENERATED = [("gpipe", 3, 1, 4), ("1f1b", 4, 1, 5), ("interleaved", 2, 3, 4), ("zb", 3, 1, 6)]


@pytest.mark.parametrize(("name", "pp", "v", "mb"), GENERATED)
def test_schedule_text_round_trips(name, pp, v, mb):
    compute_only = build_schedule(name, pp, v, mb)
    for s in (compute_only, lower_communication(compute_only)):
        assert parse_schedule(str(s)) == s


def test_schedule_text_errors_name_the_line():
    with pytest.raises(ValueError, match="line 1: expected a header"):
        parse_schedule("1f1b pp=2 mb=1\n0: 0F0 0B0\n1: 1F0 1B0")
    with pytest.raises(ValueError, match=r"line 3: not a pipeline action: '1Q0'"):
        parse_schedule("1f1b pp=2 v=1 mb=1\n0: 0F0 0B0\n1: 1Q0 1B0")
    with pytest.raises(ValueError, match=r"one action list per rank 0..1, got ranks \[0\]"):
        parse_schedule("1f1b pp=2 v=1 mb=1\n0: 0F0 0B0")


# --- generators: expected schedules written as text ------------------------------------------------

EXPECTED = {
    ("gpipe", 2, 1, 2): """
        gpipe pp=2 v=1 mb=2
        0: 0F0 0F1 0B0 0B1
        1: 1F0 1F1 1B0 1B1
    """,
    # Rank 0 warms up with pp-0-1 = 1 forward, rank 1 with none.
    ("1f1b", 2, 1, 3): """
        1f1b pp=2 v=1 mb=3
        0: 0F0 0F1 0B0 0F2 0B1 0B2
        1: 1F0 1B0 1F1 1B1 1F2 1B2
    """,
    # Rank r postpones its W by r steps; the W's it still owes close the list.
    ("zb", 2, 1, 3): """
        zb pp=2 v=1 mb=3
        0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
        1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
    """,
    # Stages 0, 2 on rank 0 and 1, 3 on rank 1; warm-up 2*(pp-r-1) + (v-1)*pp = 4 and 2.
    ("interleaved", 2, 2, 2): """
        interleaved pp=2 v=2 mb=2
        0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
        1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
    """,
}


@pytest.mark.parametrize("key", EXPECTED)
def test_generator_output(key):
    assert build_schedule(*key) == schedule(EXPECTED[key])


def test_lowering_puts_recvs_before_and_sends_after_the_compute():
    lowered = lower_communication(build_schedule("1f1b", 2, 1, 2))
    assert lowered == schedule("""
        1f1b pp=2 v=1 mb=2
        0: 0F0 0SF0>1 0F1 0SF1>1 0RB0<1 0B0 0RB1<1 0B1
        1: 1RF0<0 1F0 1B0 1SB0>0 1RF1<0 1F1 1B1 1SB1>0
    """)
    with pytest.raises(ValueError, match="already has sends/recvs"):
        lower_communication(lowered)


def test_lowering_one_rank_needs_no_transfer():
    s = build_schedule("interleaved", 1, 3, 2)
    assert lower_communication(s) == s


def test_build_schedule_refusals():
    with pytest.raises(ValueError, match="mb must be a multiple of pp: got mb=6, pp=4; use mb=8"):
        build_schedule("interleaved", 4, 2, 6)
    with pytest.raises(NotImplementedError, match="dualpipe is not implemented"):
        build_schedule("dualpipe", 2, 1, 4)
    with pytest.raises(ValueError, match="use schedule=interleaved for virtual chunks"):
        build_schedule("1f1b", 2, 2, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule 'bfs'"):
        build_schedule("bfs", 2, 1, 4)
    with pytest.raises(ValueError, match="mb >= 1"):
        build_schedule("gpipe", 2, 1, 0)


# --- every generated schedule passes the checker -------------------------------------------------


def grid():
    for pp in range(1, 5):
        for mb in range(1, 9):
            yield from (("gpipe", pp, 1, mb), ("1f1b", pp, 1, mb), ("zb", pp, 1, mb))
            yield from (("interleaved", pp, v, mb) for v in range(1, 4) if mb % pp == 0)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb"])
def test_every_generated_schedule_passes_the_checker(name):
    for key in (k for k in grid() if k[0] == name):
        compute_only = build_schedule(*key)
        metrics = check_schedule(compute_only)
        # Sends are buffered, so lowering changes neither validity nor timing.
        assert check_schedule(lower_communication(compute_only)) == metrics, key


# --- broken schedules ------------------------------------------------------------------------------


def test_backward_before_its_forward_on_the_same_rank():
    broken = schedule("""
        gpipe pp=2 v=1 mb=1
        0: 0B0 0F0
        1: 1F0 1B0
    """)
    with pytest.raises(
        ScheduleError, match=r"rank 0, position 0: 0B0 needs 0F0 first, but it comes later, at position 1"
    ):
        check_schedule(broken)


def test_weight_grad_before_its_input_grad():
    broken = schedule("""
        zb pp=1 v=1 mb=1
        0: 0F0 0W0 0I0
    """)
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: 0W0 needs 0I0 first"):
        check_schedule(broken)


def test_swapped_microbatches_across_ranks_deadlock():
    # Rank 1 wants mb 1 first, rank 0 will not forward mb 1 before mb 0's gradient is back.
    broken = schedule("""
        1f1b pp=2 v=1 mb=2
        0: 0F0 0B0 0F1 0B1
        1: 1F1 1B1 1F0 1B0
    """)
    with pytest.raises(ScheduleError, match="deadlock") as err:
        check_schedule(broken)
    assert "rank 0, position 1: 0B0 waits for 1B0 or 1I0 (rank 1)" in str(err.value)
    assert "rank 1, position 0: 1F1 waits for 0F1 (rank 0)" in str(err.value)


LOWERED_GPIPE_2_1 = str(lower_communication(build_schedule("gpipe", 2, 1, 1)))


def test_missing_recv():
    assert LOWERED_GPIPE_2_1.splitlines()[1:] == ["0: 0F0 0SF0>1 0RB0<1 0B0", "1: 1RF0<0 1F0 1B0 1SB0>0"]
    broken = parse_schedule(LOWERED_GPIPE_2_1.replace("0RB0<1 ", ""))
    with pytest.raises(
        ScheduleError, match=r"rank 1, position 3: send 1SB0>0 has no matching recv 0RB0<1 on rank 0"
    ):
        check_schedule(broken)


def test_missing_transfer():
    broken = parse_schedule(LOWERED_GPIPE_2_1.replace("0RB0<1 ", "").replace(" 1SB0>0", ""))
    with pytest.raises(
        ScheduleError, match=r"rank 0, position 2: 0B0 needs 0RB0<1 first, but rank 0 never does it"
    ):
        check_schedule(broken)


def test_recv_without_send():
    broken = parse_schedule(LOWERED_GPIPE_2_1.replace(" 1SB0>0", ""))
    with pytest.raises(
        ScheduleError, match=r"rank 0, position 2: recv 0RB0<1 has no matching send 1SB0>0 on rank 1"
    ):
        check_schedule(broken)


def test_repeated_send():
    broken = parse_schedule(LOWERED_GPIPE_2_1.replace("0SF0>1", "0SF0>1 0SF0>1"))
    with pytest.raises(
        ScheduleError, match=r"rank 0, position 2: 0SF0>1 runs a second time \(first at position 1\)"
    ):
        check_schedule(broken)


def test_cycle_of_recvs_deadlocks():
    # Each rank first waits for what the other sends only later.
    broken = schedule("""
        gpipe pp=2 v=1 mb=1
        0: 0RB0<1 0F0 0SF0>1 0B0
        1: 1RF0<0 1F0 1B0 1SB0>0
    """)
    with pytest.raises(ScheduleError, match="deadlock") as err:
        check_schedule(broken)
    assert "rank 0, position 0: 0RB0<1 waits for 1SB0>0 (rank 1)" in str(err.value)
    assert "rank 1, position 0: 1RF0<0 waits for 0SF0>1 (rank 0)" in str(err.value)


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ("0: 0F0 0B0\n1: 1F0", r"stage 1 \(rank 1\), microbatch 0 has no backward"),
        ("0: 0F0 0B0 0F0\n1: 1F0 1B0", r"rank 0, position 2: 0F0 runs a second time"),
        ("0: 0F0 0B0\n1: 1B0", r"stage 1 \(rank 1\), microbatch 0 has no forward 1F0"),
        ("0: 0F0 0B0 1F0\n1: 1B0", r"rank 0, position 2: 1F0 is stage 1, which lives on rank 1"),
        ("0: 0F0 0B0 0F1\n1: 1F0 1B0", r"rank 0, position 2: 0F1 names microbatch 1, but mb = 1"),
        (
            "0: 0F0 0I0 0W0\n1: 1F0 1I0 1B0",
            r"stage 1 \(rank 1\), microbatch 0 mixes a full backward B with split I/W",
        ),
    ],
)
def test_missing_or_repeated_work(rows, message):
    with pytest.raises(ScheduleError, match=message):
        check_schedule(parse_schedule("s pp=2 v=1 mb=1\n" + rows))


# --- metrics ---------------------------------------------------------------------------------------
# Unit costs F=1, B=2 (I=W=1). p=4, m=8, by hand:
# GPipe: the last rank starts at p-1=3, runs 8 F and 8 B back to back (24) and ends at 27; each rank
#   above finishes its last B 2 later, so rank 0 ends at 27 + 2*3 = 33 = 3(m+p-1). Every rank
#   computes 3m = 24, so idles 9: bubble fraction 9/33 = (p-1)/(m+p-1), ratio 9/24 = (p-1)/m.
# 1F1B: the same makespan and idle time (it only reorders to hold fewer activations).
# Interleaved v=2 (chunk costs F=1, B=2): 3vm = 48 compute per rank, the same 3(p-1) = 9 idle:
#   makespan 57, ratio 9/48 = (p-1)/(vm).
# ZB-H1: the last rank starts at 3 and never idles, 3m = 24 of F, I, W; ends at 27 = 3m+p-1,
#   every rank idles p-1 = 3: fraction 3/27, ratio 3/24 = (p-1)/(3m).
P4M8 = [
    # name, v, makespan, bubble_fraction, bubble_ratio, peak in flight per rank
    ("gpipe", 1, 33, Fraction(9, 33), Fraction(3, 8), (8, 8, 8, 8)),
    ("1f1b", 1, 33, Fraction(9, 33), Fraction(3, 8), (4, 3, 2, 1)),
    ("interleaved", 2, 57, Fraction(9, 57), Fraction(3, 16), (11, 9, 7, 5)),
    ("zb", 1, 27, Fraction(3, 27), Fraction(1, 8), (4, 3, 2, 1)),
]


@pytest.mark.parametrize(("name", "v", "makespan", "fraction", "ratio", "peak"), P4M8)
def test_metrics_p4_m8(name, v, makespan, fraction, ratio, peak):
    metrics = check_schedule(build_schedule(name, 4, v, 8))
    assert metrics.makespan == makespan
    assert exact(metrics.bubble_fraction) == fraction
    assert all(exact(f) == fraction for f in metrics.idle_fraction)
    assert exact(metrics.bubble_ratio) == ratio
    assert metrics.peak_in_flight == peak


def test_bubble_formulas_over_the_grid():
    for name, p, v, m in grid():
        ratio = exact(check_schedule(build_schedule(name, p, v, m)).bubble_ratio)
        one_f_one_b = exact(check_schedule(build_schedule("1f1b", p, 1, m)).bubble_ratio)
        if name in ("gpipe", "1f1b"):
            assert ratio == Fraction(p - 1, m), (name, p, m)
        if name == "interleaved":
            assert ratio == Fraction(p - 1, v * m), (p, v, m)
        if name == "zb":
            assert ratio <= one_f_one_b and (p == 1 or ratio < one_f_one_b), (p, m)
            assert m < p or ratio == Fraction(p - 1, 3 * m), (p, m)


def test_peak_in_flight_on_rank_0():
    for p in range(1, 5):
        for m in range(p, 9):
            assert check_schedule(build_schedule("1f1b", p, 1, m)).peak_in_flight[0] == p
            assert check_schedule(build_schedule("zb", p, 1, m)).peak_in_flight[0] == p
            assert check_schedule(build_schedule("gpipe", p, 1, m)).peak_in_flight[0] == m


def test_simulated_slots_of_1f1b():
    timeline = simulate(build_schedule("1f1b", 2, 1, 2))
    assert [(s.start, s.end, str(s.action)) for s in timeline.slots[1]] == [
        (1, 2, "1F0"),
        (2, 4, "1B0"),
        (4, 5, "1F1"),
        (5, 7, "1B1"),
    ]


# --- picture ---------------------------------------------------------------------------------------


def test_render_gpipe_pp2_mb2():
    assert render_timeline(build_schedule("gpipe", 2, 1, 2)) == textwrap.dedent("""\
        rank 0 | F0 F1 .. .. .. B0 B0 B1 B1
        rank 1 | .. F0 F1 B0 B0 B1 B1 .. ..""")


def test_render_shows_chunks_and_ignores_transfers():
    s = build_schedule("interleaved", 2, 2, 2)
    picture = render_timeline(s)
    assert picture == render_timeline(lower_communication(s))
    assert picture.splitlines()[1] == "rank 1 | ... 1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1B0 1B0 1B1 1B1 ... ..."


# --- properties over random sizes (the "Done means") ----------------------------------------


@st.composite
def sizes(draw):
    p, v = draw(st.integers(1, 8)), draw(st.integers(1, 4))
    return p, v, p * draw(st.integers(1, 4))  # interleaved needs m a multiple of p


@given(sizes())
def test_random_sizes_pass_the_checker_and_meet_the_bubble_formulas(size):
    p, v, m = size
    metrics = {name: check_schedule(build_schedule(name, p, v if name == "interleaved" else 1, m))
               for name in ("gpipe", "1f1b", "interleaved", "zb")}
    for name in ("gpipe", "1f1b"):
        assert exact(metrics[name].bubble_ratio) == Fraction(p - 1, m)
    assert exact(metrics["interleaved"].bubble_ratio) == Fraction(p - 1, v * m)
    assert exact(metrics["zb"].bubble_ratio) == Fraction(p - 1, 3 * m)
    assert p == 1 or metrics["zb"].bubble_ratio < metrics["1f1b"].bubble_ratio
    assert metrics["1f1b"].peak_in_flight[0] == p and metrics["zb"].peak_in_flight[0] == p
    assert metrics["gpipe"].peak_in_flight[0] == m
    lowered = lower_communication(build_schedule("interleaved", p, v, m))
    assert check_schedule(lowered) == metrics["interleaved"]
