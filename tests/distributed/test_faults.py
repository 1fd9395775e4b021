"""The bad-input and fault tier: every row gives its clear usc error on every rank within its bound, and
the next good step equals the run that never saw the fault (bitwise: same plan, same batches).

Default suite: the bad inputs on the simulator under dp, tp, pp and zero=3 (one compiled object per plan
for every row), the one-rank NaN verdict, the fingerprint exchange, and one gloo world. USC_DEEP_TIER=1
adds the full product on gloo: every bad input and every fault (a rank killed with SIGKILL, a stuck rank,
ranks launched with another seed, plan, batch shape or job id, Ctrl-C while blocked) under each plan
kind. The checkpoint rows (crash between the renames, flipped bytes, truncated and foreign checkpoints)
live in test_checkpoints.py and the hostile cache directory in tests/runtime/test_kernel_cache.py.
"""

from __future__ import annotations

import io
import os
import time

import pytest
import torch

import usc
from fault_cases import BAD_INPUTS, bad_batch, batches, fault_world, foreign_rank_world, heal, nan_on_one_rank, sgd
from harness import run_world
from usc.compiler.program import InputSpec
from usc.runtime.agreement import Fingerprint, RanksDisagree, agree, fingerprint
from usc.runtime.mesh import run_in_threads, simulated_meshes
from usc.testing.equivalence import compare_states, reference_run
from usc.testing.models import TinyLlama

DEEP = os.environ.get("USC_DEEP_TIER") == "1"
PLANS = ["dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"]
SIMULATED_BOUND_S = 5.0  # a refused step on the simulator: checks on the host, nothing waits


def _simulated(plan: str) -> usc.Simulated:
    torch.manual_seed(0)
    return usc.simulate(TinyLlama(), plan, example_inputs=batches()[0], optimizer=sgd)


def _clean_run(plan: str) -> tuple[list[float], dict]:
    sim = _simulated(plan)
    losses = [sim.step(*b) for b in batches()]
    return losses, sim.full_state_dict()


def _snapshot(sim) -> list:
    """Everything a step may change, per rank: state, optimizer state, step count; and torch's RNG."""
    out = [torch.get_rng_state()]
    for rank in sim.ranks:
        optimizer = {k: {n: v.clone() for n, v in s.items() if isinstance(v, torch.Tensor)}
                     for k, s in rank.torch_optimizer.state_dict()["state"].items()}
        out.append((rank.steps_done, rank.local_state(), optimizer))
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _assert_equal_to_clean(sim, clean: tuple[list[float], dict]) -> None:
    losses, state = clean
    assert sim.step(*batches()[1]) == losses[1]
    after = sim.full_state_dict()
    assert [k for k in state if not torch.equal(after[k], state[k])] == []


def _refused(sim, batch, expected) -> tuple[BaseException, float]:
    before = _snapshot(sim)
    start = time.perf_counter()
    with pytest.raises(expected) as info:
        sim.step(*batch)
    seconds = time.perf_counter() - start
    assert _same(_snapshot(sim), before), "a refused step changed the state"
    return info.value, seconds


@pytest.mark.parametrize("plan", PLANS)
def test_bad_inputs_are_refused_on_every_rank_and_the_next_step_equals_the_clean_run(plan):
    clean = _clean_run(plan)
    sim = _simulated(plan)
    assert sim.step(*batches()[0]) == clean[0][0]
    for row, expected in BAD_INPUTS.items():
        error, seconds = _refused(sim, bad_batch(row, batches()[1]), expected)
        assert seconds < SIMULATED_BOUND_S, f"{row}: {seconds:.2f} s"
        assert "rank" in str(error), str(error)
        assert getattr(error, "raised_by_every_rank", False)  # the simulator saw no rank abort its peers
    # the rows name what is wrong: the input, the bad value, what it indexes
    error, _ = _refused(sim, bad_batch("id out of range", batches()[1]), usc.InputOutOfRange)
    assert (error.input, error.value) == ("batch[0]", 131) and "128 embedding rows" in str(error)
    error, _ = _refused(sim, bad_batch("label out of range", batches()[1]), IndexError)
    assert (error.input, error.value) == ("batch[1]", -1)
    error, _ = _refused(sim, bad_batch("every label ignored", batches()[1]), usc.NonFiniteLoss)
    assert error.step == 2 and "ignore_index" in str(error)
    _assert_equal_to_clean(sim, clean)


@pytest.mark.parametrize("plan", ["tp=2", "pp=2 mb=2"] + (["dp=2 tp=2", "dp=2 zero=3"] if DEEP else []))
def test_a_nan_seen_by_one_rank_stops_every_rank(plan):
    """The loss is a copy on every tp rank: one rank's NaN must still be every rank's verdict."""
    clean = _clean_run(plan)
    sim = _simulated(plan)
    sim.step(*batches()[0])
    nan_on_one_rank(sim.ranks[1])
    error, _ = _refused(sim, batches()[1], usc.NonFiniteLoss)
    assert error.step == 2
    heal(sim.ranks[1])
    _assert_equal_to_clean(sim, clean)


@pytest.mark.parametrize("row", ["label out of range"] + (["id out of range"] if DEEP else []))
def test_under_vocabulary_parallelism_an_index_no_rank_holds_stops_the_step_without_the_host_check(row):
    """A batch on the device skips the host check: the vocabulary-parallel ops themselves turn an index
    outside every rank's slice into a NaN loss, which every rank refuses (it used to read zeros)."""
    clean = _clean_run("dp=2 tp=2")
    sim = _simulated("dp=2 tp=2")
    sim.step(*batches()[0])
    for rank in sim.ranks:
        rank._index_uses = []  # as for a batch already on a GPU
    error, _ = _refused(sim, bad_batch(row, batches()[1]), usc.NonFiniteLoss)
    assert "outside the vocabulary" in str(error) or "loss is nan" in str(error)
    _assert_equal_to_clean(sim, clean)


def test_the_simulator_survives_a_rank_failing_mid_step():
    """A rank that raises inside its forward aborts its peers' collectives; the next call starts clean."""
    plan = "dp=2 tp=2"
    clean = _clean_run(plan)
    sim = _simulated(plan)
    sim.step(*batches()[0])
    original = sim.ranks[3]._loss

    def broken(batch):
        raise RuntimeError("a bug in rank 3's forward")

    sim.ranks[3]._loss = broken
    with pytest.raises(RuntimeError, match="rank 3's forward"):
        sim.step(*batches()[1])
    sim.ranks[3]._loss = original
    assert sim.full_state_dict().keys() == clean[1].keys()  # usable at once, a collective call included
    _assert_equal_to_clean(sim, clean)


# ------------------------------------------------------------------------------------ agreement
def _fingerprints(model_seed: int, plan: str = "dp=2") -> Fingerprint:
    torch.manual_seed(model_seed)
    inputs = [InputSpec("ids", None, (4, 16), torch.int64), InputSpec("labels", None, (4, 16), torch.int64)]
    return fingerprint(plan=plan, state=TinyLlama().state_dict(), inputs=inputs, versions="usc test")


def _agree_on_every_rank(meshes, mine: list) -> list:
    """Each simulated rank's RanksDisagree (None where it agreed) when rank r brings ``mine[r]``."""
    def each(mesh):
        try:
            agree(mesh, mine[mesh.rank])
        except RanksDisagree as err:
            return err
        return None
    return run_in_threads(meshes, each, timeout=10.0)


def test_ranks_built_differently_are_named_by_every_rank():
    same, other_seed = _fingerprints(0), _fingerprints(1)
    assert same.fields == _fingerprints(0).fields  # deterministic: the same model hashes the same
    other_plan = Fingerprint({**same.fields, "plan": "dp=2 dtype=bf16"})
    mine = [same, other_seed, same, other_plan]
    meshes = simulated_meshes(("dp", "tp"), (2, 2), timeout=10.0)
    errors = _agree_on_every_rank(meshes, mine)
    assert all(isinstance(e, RanksDisagree) for e in errors)  # every rank, not only the odd ones
    assert errors[0].differing == {"plan": [[0, 1, 2], [3]], "parameter checksum": [[0, 2, 3], [1]]}
    assert "plan differs: ranks [0, 1, 2] vs ranks [3] (rank 3 has: dp=2 dtype=bf16)" in str(errors[3])
    assert run_in_threads(meshes, lambda m: agree(m, same), timeout=10.0) == [None] * 4


def test_ranks_that_compiled_different_programs_are_told_the_compile_differed():
    """Ranks launched alike whose programs differ (the trace or the compile read something of its
    process) are refused like ranks launched differently; alone, the program's field names the way to
    find the node, since relaunching alike would not mend it. Beside another differing field, it
    defers to that field."""
    from usc.runtime.agreement import PROGRAM, PROGRAM_FIX

    same = _fingerprints(0)
    other_program = Fingerprint({**same.fields, PROGRAM: "0" * 16})
    other_plan_too = Fingerprint({**other_program.fields, "plan": "dp=2 dtype=bf16"})
    meshes = simulated_meshes(("dp",), (4,), timeout=10.0)
    alone = _agree_on_every_rank(meshes, [same, same, other_program, same])
    assert all(e.differing == {PROGRAM: [[0, 1, 3], [2]]} for e in alone)
    assert f"{PROGRAM} differs: ranks [0, 1, 3] vs ranks [2]" in str(alone[0])
    assert str(alone[0]).endswith(PROGRAM_FIX) and "launch every rank" not in str(alone[0])
    beside = _agree_on_every_rank(meshes, [same, same, other_plan_too, same])
    assert list(beside[1].differing) == ["plan", PROGRAM]
    assert "(which the fields above may explain)" in str(beside[1]) and PROGRAM_FIX not in str(beside[1])


@pytest.mark.distributed
def test_gloo_ranks_whose_programs_differ_are_refused_before_training():
    """Two gloo processes, rank 1's program holding one more (harmless) node: both refuse at the
    first step, naming the program and how to find where it differs."""
    from usc.runtime.agreement import PROGRAM, PROGRAM_FIX

    results = run_world(fault_world, 2, "dp=2 timeout=20", "other program", timeout=240)
    assert [r["error"] for r in results] == ["RanksDisagree"] * 2, [r["message"] for r in results]
    for r in results:
        assert f"{PROGRAM} differs: ranks [0] vs ranks [1]" in r["message"] and PROGRAM_FIX in r["message"]


@pytest.mark.distributed
def test_gloo_ranks_whose_forward_reads_the_rank_are_refused_before_training():
    """A model whose forward reads RANK (rank 0 doubles its loss): each rank traces its own forward,
    so the two compile different programs, which would train rank 0's gradients twice over. Both
    ranks refuse at the first step and name the program."""
    from usc.runtime.agreement import PROGRAM, PROGRAM_FIX

    results = run_world(fault_world, 2, "dp=2 timeout=20", "forward reads the rank", timeout=240)
    assert [r["error"] for r in results] == ["RanksDisagree"] * 2, [r["message"] for r in results]
    assert all(PROGRAM_FIX in r["message"] and f"{PROGRAM} differs" in r["message"] for r in results)


# ------------------------------------------------------------------------------------ gloo
GLOO_BOUND_S = 10.0  # refused or failed steps on gloo (a stuck rank: its plan's timeout=2 s)
FAULTS = {  # row -> (error of rank 0, error of rank 1: the faulty one, which may die)
    **{row: (error.__name__, error.__name__) for row, error in BAD_INPUTS.items()},
    "NaN on one rank": ("NonFiniteLoss", "NonFiniteLoss"),
    "other seed": ("RanksDisagree", "RanksDisagree"),
    "other plan": ("RanksDisagree", "RanksDisagree"),
    "other batch shape": ("RanksDisagree", "RanksDisagree"),
    "other program": ("RanksDisagree", "RanksDisagree"),
    "forward reads the rank": ("RanksDisagree", "RanksDisagree"),
    "killed rank": ("CollectiveError", None),  # rank 1 is killed with SIGKILL
    "stuck rank": ("CollectiveTimeout", "CollectiveError"),  # rank 1 wakes after rank 0 left
    "Ctrl-C while blocked": ("KeyboardInterrupt", "CollectiveError"),  # rank 1 is late, rank 0 interrupted
}
GLOO_PLANS = ["dp=2", "tp=2", "pp=2 mb=2", "dp=2 zero=3"]


def _gloo_clean(plan: str) -> tuple[float, dict]:
    results = run_world(fault_world, 2, f"{plan} timeout=20", "clean", timeout=240)
    return results[0]["loss"], torch.load(io.BytesIO(results[0]["state"]))


def _gloo_row(plan: str, fault: str, clean) -> list[dict]:
    expected = FAULTS[fault]
    timeout = "timeout=2" if fault == "stuck rank" else "timeout=20"
    may_die = [1] if expected[1] is None else []
    results = run_world(fault_world, 2, f"{plan} {timeout}", fault, timeout=240, may_die=may_die)
    got = tuple(r and r["error"] for r in results)
    assert got == expected, [r and r["message"] for r in results]
    assert results[0]["seconds"] < GLOO_BOUND_S, (fault, results[0]["seconds"])
    if "loss" in results[0]:
        assert results[0]["loss"] == results[1]["loss"] == clean[0]
        state = torch.load(io.BytesIO(results[0]["state"]))
        assert [k for k in clean[1] if not torch.equal(state[k], clean[1][k])] == []
    return results


@pytest.mark.distributed
def test_gloo_ranks_refuse_an_out_of_range_id_alike_and_train_on():
    """One world: both ranks refuse the batch (neither is left in a collective), then train on like one device."""
    results = run_world(fault_world, 2, "dp=2 timeout=20", "id out of range", timeout=240)
    assert [r["error"] for r in results] == ["InputOutOfRange"] * 2, [r["message"] for r in results]
    torch.manual_seed(0)
    reference = TinyLlama()
    losses = reference_run(reference, batches(), sgd)
    assert results[0]["loss"] == results[1]["loss"] == pytest.approx(losses[1], rel=1e-5)
    worst, _ = compare_states(torch.load(io.BytesIO(results[0]["state"])), reference.state_dict(), atol=1e-5)
    assert worst <= 1e-5


@pytest.mark.skipif(not DEEP, reason="deep tier: set USC_DEEP_TIER=1")
def test_a_rank_of_another_job_on_the_port_cannot_join():
    """Job A (2 ranks) and rank 1 of job B start on one port: A trains like one device, B's rank waits
    apart under its own job id and fails with a LaunchError naming the job."""
    results = run_world(foreign_rank_world, 3, "dp=2 timeout=8", timeout=240)
    a0, a1, foreign = results
    assert a0["error"] is None and a0["losses"] == a1["losses"], (a0, a1)
    torch.manual_seed(0)
    reference = reference_run(TinyLlama(), batches(), sgd)
    assert a0["losses"] == pytest.approx(reference, rel=1e-5)
    assert foreign["error"] == "LaunchError" and "job job-b" in foreign["message"], foreign
    print(f"| dp=2 | foreign rank on the port | {foreign['error']} | {foreign['seconds']:.2f} s (timeout=8) |")


@pytest.mark.skipif(not DEEP, reason="deep tier: set USC_DEEP_TIER=1")
@pytest.mark.parametrize("plan", GLOO_PLANS)
def test_gloo_fault_tier(plan):
    clean = _gloo_clean(plan)
    for fault in FAULTS:
        start = time.monotonic()
        results = _gloo_row(plan, fault, clean)
        row = results[0]
        world = time.monotonic() - start
        print(f"| {plan} | {fault} | {row['error']} | {row['seconds']:.2f} s | world {world:.1f} s |")


# ------------------------------------------------------------------------------------ checkpoints
class Crash(BaseException):
    """A process killed mid-save: no handler runs."""


def _largest_piece_file(path):
    return max((p for p in path.iterdir() if p.suffix == ".pt"), key=lambda p: p.stat().st_size)


def _flip(path) -> None:
    target = _largest_piece_file(path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def _truncate(path) -> None:
    target = _largest_piece_file(path)
    target.write_bytes(target.read_bytes()[:100])


def _crash_between_renames(sim, path, monkeypatch) -> None:
    from usc.runtime import checkpoint

    renames, real_rename = {"n": 0}, os.rename

    def dying_rename(src, dst):
        if renames["n"] == 1:
            raise Crash()
        renames["n"] += 1
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", dying_rename)
    with pytest.raises(Crash):
        sim.save(path)
    monkeypatch.undo()


@pytest.mark.parametrize("plan", PLANS if DEEP else ["tp=2"])  # about 4 s a plan: the others in the deep tier
def test_damaged_checkpoints_are_refused_and_the_run_goes_on_like_the_clean_one(tmp_path, monkeypatch, plan):
    from usc.testing.models import LlamaConfig

    clean = _clean_run(plan)
    sim = _simulated(plan)
    sim.step(*batches()[0])
    good = tmp_path / "good"
    sim.save(good)
    for name, damage in [("flipped", _flip), ("truncated", _truncate)]:
        path = tmp_path / name
        sim.save(path)
        damage(path)
        before = _snapshot(sim)
        with pytest.raises(usc.CheckpointError, match="rank"):
            sim.load(path)
        assert _same(_snapshot(sim), before), f"a refused {name} checkpoint changed the state"
    torch.manual_seed(0)
    other = usc.simulate(TinyLlama(LlamaConfig(layers=3)), plan, example_inputs=batches()[0], optimizer=sgd)
    other.save(tmp_path / "foreign")
    with pytest.raises(usc.CheckpointError, match="unexpected"):
        sim.load(tmp_path / "foreign")
    _crash_between_renames(sim, good, monkeypatch)  # the second save of `good` dies after one rename
    sim.load(good)  # the complete copy beside the name
    _assert_equal_to_clean(sim, clean)


@pytest.mark.parametrize("plan", ["dp=2", "tp=2"])
def test_nan_and_inf_in_float_inputs_stop_every_rank(plan):
    """A model of torch's own modules on float features: a NaN or an Inf in one sample (one dp shard)
    is every rank's NonFiniteLoss, and the run goes on as if it never came."""
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
        return usc.simulate(model, plan, example_inputs=data[0], loss_fn=torch.nn.functional.mse_loss,
                            optimizer=sgd)

    generator = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, 6, generator=generator), torch.randn(6, 3, generator=generator)) for _ in range(2)]
    clean = build()
    expected = [clean.step(*b) for b in data]
    sim = build()
    assert sim.step(*data[0]) == expected[0]
    for bad in (float("nan"), float("inf")):
        x = data[1][0].clone()
        x[5, 2] = bad
        error, _ = _refused(sim, (x, data[1][1]), usc.NonFiniteLoss)
        assert error.step == 2
    assert sim.step(*data[1]) == expected[1]
    after, reference = sim.full_state_dict(), clean.full_state_dict()
    assert all(torch.equal(after[k], reference[k]) for k in reference)
