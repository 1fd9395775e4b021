"""Timeline: interval arithmetic for exposed comm, Chrome trace output, comm spans."""

import json

import pytest

import torch
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.runtime.timeline import Span, Timeline


def _timeline(spans):
    tl = Timeline()
    tl._spans.extend(Span(n, c, s, e, r, 1) for n, c, s, e, r in spans)
    return tl


def test_exposed_comm_subtracts_overlapping_compute():
    tl = _timeline(
        [
            ("mm", "compute", 0.0, 2.0, 0),
            ("ar", "comm", 1.0, 3.0, 0),  # 1..2 hidden, 2..3 exposed
            ("ag", "comm", 2.5, 3.5, 0),  # overlaps the other comm: 3..3.5 exposed
            ("mm", "compute", 3.4, 4.0, 0),  # hides 3.4..3.5
            ("ar", "comm", 0.0, 1.0, 1),  # other rank: compute of rank 0 does not hide it
        ]
    )
    assert abs(tl.exposed_comm_seconds(rank=0) - (1.0 + 0.4)) < 1e-9
    assert abs(tl.exposed_comm_seconds(rank=1) - 1.0) < 1e-9
    assert abs(tl.exposed_comm_seconds() - 2.4) < 1e-9


def test_chrome_trace_has_complete_events_per_rank(tmp_path):
    tl = _timeline([("mm", "compute", 1.0, 1.5, 0), ("ar", "comm", 1.2, 2.0, 3)])
    path = tmp_path / "trace.json"
    tl.to_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert [(e["name"], e["ph"], e["pid"], e["cat"]) for e in events] == [
        ("mm", "X", 0, "compute"),
        ("ar", "X", 3, "comm"),
    ]
    assert abs(events[1]["ts"] - 0.2e6) < 1e-3 and abs(events[1]["dur"] - 0.8e6) < 1e-3


def test_comms_record_spans_only_when_a_timeline_is_attached():
    meshes = simulated_meshes(("tp",), (2,), timeout=5.0)
    tl = Timeline()
    meshes[0].set_timeline(tl)
    meshes[1].set_timeline(tl)

    def rank(mesh):
        with tl.span("matmul", "compute", rank=mesh.rank):
            torch.ones(8, 8) @ torch.ones(8, 8)
        _, work = mesh.comm("tp").all_reduce(torch.ones(2), async_op=True)
        work.wait()
        mesh.comm("tp").all_gather(torch.ones(2), 0)

    run_in_threads(meshes, rank, timeout=5.0)
    names = sorted((s.rank, s.name) for s in tl.spans if s.category in ("comm", "comm-sync"))
    assert names == [
        (0, "all-gather[tp]"),
        (0, "all-reduce[tp]"),
        (1, "all-gather[tp]"),
        (1, "all-reduce[tp]"),
    ]
    assert tl.exposed_comm_seconds() >= 0.0


def test_blocking_comm_inside_a_compute_span_is_exposed():
    """A blocking all-reduce inside a forward span hides nothing: the forward waits on it."""
    tl = _timeline([("forward", "compute", 0.0, 4.0, 0), ("ar", "comm-sync", 1.0, 2.0, 0),
                    ("bucket", "comm", 3.0, 5.0, 0)])
    # blocking 1..2 exposed; async 3..4 hidden by compute, 4..5 exposed.
    assert tl.exposed_comm_seconds(rank=0) == pytest.approx(2.0)
