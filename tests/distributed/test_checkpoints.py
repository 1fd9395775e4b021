"""Sharded checkpoints: written piece by piece, loaded under other plans, and surviving crashes at
every step of a save, damaged bytes and foreign checkpoints — each with a usc CheckpointError."""

import json
import os
import shutil
import time

import pytest
import torch

import usc
from harness import run_world
from usc.runtime import checkpoint, checkpoint_state
from usc.testing.equivalence import compare_states, reference_run
from usc.testing.memory_counters import PeakAllocations
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

BATCHES = [token_batch(128, 4, 16, seed=s) for s in range(4)]


def _reference():
    torch.manual_seed(0)
    reference = TinyLlama()
    expected = reference_run(reference, BATCHES, lambda p: torch.optim.AdamW(p))
    return reference, expected


def _trained(plan, steps=2, model=None, optimizer=None):
    torch.manual_seed(0)
    sim = usc.simulate(model or TinyLlama(), plan, example_inputs=BATCHES[0], optimizer=optimizer)
    for batch in BATCHES[:steps]:
        sim.step(*batch)
    return sim


def _continue_equals_one_device(path, plan):
    reference, expected = _reference()
    torch.manual_seed(1)  # other random weights: everything must come from the checkpoint
    resumed = usc.simulate(TinyLlama(), plan, example_inputs=BATCHES[0])
    resumed.load(path)
    losses = [resumed.step(*b) for b in BATCHES[2:]]
    assert losses == pytest.approx(expected[2:], rel=1e-5, abs=1e-6)
    worst, _ = compare_states(resumed.full_state_dict(), reference.state_dict(), atol=1e-5)
    assert worst <= 1e-5


@pytest.mark.parametrize("plan_a, plan_b", [("dp=2 tp=2 zero=3", "pp=2 tp=2"), ("dp=2 tp=2 zero=2", "dp=4 zero=3"),
                                            ("pp=2 tp=2 mb=2", "dp=2 tp=2 zero=1"), ("dp=4 zero=3", "dp=2 zero=2 mb=2")])
def test_sharded_save_loads_under_another_plan_and_continues_like_one_device(tmp_path, plan_a, plan_b):
    sim = _trained(plan_a)
    sim.save(tmp_path / "ckpt")
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert files.count(".metadata") == 1 and sum(f.endswith(".pt") for f in files) == sim.plan.world_size
    _continue_equals_one_device(tmp_path / "ckpt", plan_b)


def test_each_rank_writes_only_its_share(tmp_path):
    """dp=2 tp=2 zero=3: four disjoint quarters; nothing is written twice."""
    sim = _trained("dp=2 tp=2 zero=3", steps=1)
    sim.save(tmp_path / "ckpt")
    header = json.loads((tmp_path / "ckpt" / ".metadata").read_text().split("\n", 1)[1])
    per_file = {}
    for piece in header["pieces"]:
        count = 1
        for s in piece["sizes"]:
            count *= s
        held = piece["flat"][1] - piece["flat"][0] if piece["flat"] else count
        per_file[piece["file"]] = per_file.get(piece["file"], 0) + held
    params = sum(p.numel() for p in TinyLlama().parameters())
    total = sum(s.numel() for s in [torch.Size(spec.global_shape) for spec in sim.program.state]) + 2 * params
    scalars = sum(1 for p in header["pieces"] if not p["shape"])  # the optimizer's step counts
    assert sum(per_file.values()) == total + scalars
    assert max(per_file.values()) <= total / 4 * 1.05


def peak_bytes_while_saving(sim, path) -> list[int]:
    """Each rank's peak of bytes allocated by torch ops during its part of the save."""
    peaks = {}
    original = checkpoint_state.save

    def measured(rank, *args):
        with PeakAllocations() as mode:
            original(rank, *args)
        peaks[rank.mesh.rank] = mode.peak

    checkpoint_state.save = measured
    try:
        sim.save(path)
    finally:
        checkpoint_state.save = original
    return [peaks[r] for r in sorted(peaks)]


def test_no_rank_materialises_what_it_does_not_own_while_saving(tmp_path):
    """dp=4 tp=2 zero=3: a rank holds 1/8 of the model; saving allocates nothing near a full parameter."""
    model = TinyLlama(LlamaConfig(layers=4))
    sim = _trained("dp=4 tp=2 zero=3", steps=1, model=model)
    largest = max(p.numel() * 4 for p in model.parameters())
    share = sum(sum(r.memory_bytes().values()) for r in sim.ranks) / len(sim.ranks)
    peaks = peak_bytes_while_saving(sim, tmp_path / "ckpt")
    assert max(peaks) < largest / 4, (peaks, largest)  # a full parameter is never built
    assert max(peaks) < share / 8, (peaks, share)


# ----------------------------------------------------------------------------- crash safety
def _state(sim):
    return {k: v.clone() for k, v in sim.full_state_dict().items()}


def _assert_loads(path, expected_state):
    fresh = usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0])
    fresh.load(path)
    got = fresh.full_state_dict()
    for name, value in expected_state.items():
        assert torch.equal(got[name], value), name


FAULTS = {  # where the save dies -> which checkpoint a load finds afterwards
    "a rank's pieces": ("write_pieces", "old"),
    "the metadata": ("write_metadata", "old"),
    "the commit": ("commit", "old"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, fault):
    name, survivor = FAULTS[fault]
    sim = _trained("dp=2 zero=2", steps=1)
    sim.save(tmp_path / "ckpt")
    old = _state(sim)
    sim.step(*BATCHES[1])
    original = getattr(checkpoint, name)

    def failing(*args, **kwargs):
        if name != "write_pieces" or args[1] == 1:  # write_pieces: only rank 1 fails
            raise OSError(f"injected failure in {name}")
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpoint, name, failing)
    with pytest.raises(usc.CheckpointError, match="could not"):
        sim.save(tmp_path / "ckpt")
    monkeypatch.undo()
    _assert_loads(tmp_path / "ckpt", old)
    sim.save(tmp_path / "ckpt")  # the next save works and cleans what the failed one left
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    _assert_loads(tmp_path / "ckpt", _state(sim))


class Crash(BaseException):
    """A process killed mid-save: no handler runs."""


@pytest.mark.parametrize("crash_after", [0, 1])
def test_a_crash_between_the_renames_is_recovered(tmp_path, monkeypatch, crash_after):
    """Killed after the first rename (the old copy moved aside, the new one not yet in place) or
    before any: the name is empty or old, and the loader finds the newest complete copy."""
    sim = _trained("dp=2", steps=1)
    sim.save(tmp_path / "ckpt")
    sim.step(*BATCHES[1])
    new = _state(sim)
    renames = {"n": 0}
    real_rename = os.rename

    def dying_rename(src, dst):
        if renames["n"] == crash_after:
            raise Crash()
        renames["n"] += 1
        real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", dying_rename)
    with pytest.raises(BaseException):
        sim.save(tmp_path / "ckpt")
    monkeypatch.undo()
    assert ("ckpt" in os.listdir(tmp_path)) == (crash_after == 0)
    if crash_after == 1:
        _assert_loads(tmp_path / "ckpt", new)  # the complete new copy beside the name


def test_an_interrupted_staging_directory_is_not_a_checkpoint(tmp_path):
    (tmp_path / ".ckpt.tmp-0000000000000001").mkdir()
    (tmp_path / ".ckpt.tmp-0000000000000001" / "rank00000.pt").write_bytes(b"partial")
    with pytest.raises(usc.CheckpointError, match="no checkpoint"):
        usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0]).load(tmp_path / "ckpt")


# ----------------------------------------------------------------------------- damage
def _saved(tmp_path, plan="dp=2 tp=2", **kwargs):
    sim = _trained(plan, steps=1, **kwargs)
    sim.save(tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture(scope="module")
def saved_once(tmp_path_factory):
    """One dp=2 tp=2 checkpoint for the damage tests; each damages its own copy (``_copy``)."""
    return _saved(tmp_path_factory.mktemp("saved"))


def _copy(saved, tmp_path):
    return shutil.copytree(saved, tmp_path / "ckpt")


@pytest.mark.parametrize("where", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99])
def test_a_flipped_byte_is_named(saved_once, tmp_path, where):
    path = _copy(saved_once, tmp_path)
    target = path / "rank00000.pt"
    data = bytearray(target.read_bytes())
    data[int(len(data) * where)] ^= 0xFF
    target.write_bytes(bytes(data))
    with pytest.raises(usc.CheckpointError, match="rank00000.pt"):
        usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0]).load(path)


@pytest.mark.parametrize("damage", ["truncate", "garbage", "flip"])
def test_damaged_metadata_is_a_checkpoint_error(saved_once, tmp_path, damage):
    path = _copy(saved_once, tmp_path)
    meta = path / ".metadata"
    raw = meta.read_bytes()
    meta.write_bytes({"truncate": raw[: len(raw) // 2], "garbage": os.urandom(200),
                      "flip": raw[:-10] + bytes([raw[-10] ^ 1]) + raw[-9:]}[damage])
    with pytest.raises(usc.CheckpointError, match=".metadata"):
        usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0]).load(path)


def test_a_truncated_piece_file_is_a_checkpoint_error(saved_once, tmp_path):
    path = _copy(saved_once, tmp_path)
    target = path / "rank00001.pt"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(usc.CheckpointError, match="rank00001.pt"):
        usc.simulate(TinyLlama(), "tp=2", example_inputs=BATCHES[0]).load(path)
    assert issubclass(usc.CheckpointError, Exception)  # a script's `except Exception` sees it


def test_another_models_checkpoint_lists_the_differences(tmp_path):
    path = _saved(tmp_path, model=TinyLlama(LlamaConfig(layers=3)))
    sim = usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0])
    with pytest.raises(usc.CheckpointError, match=r"unexpected \[.*layers\.2\."):
        sim.load(path)
    before = _state(sim)
    result = sim.load(path, strict=False)  # explicit: take what matches
    assert result.unexpected and all("layers.2." in n for n in result.unexpected) and not result.missing
    assert not torch.equal(_state(sim)["layers.0.mlp.up_proj.weight"], before["layers.0.mlp.up_proj.weight"])


def test_another_optimizers_state_is_refused(tmp_path):
    path = _saved(tmp_path, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    sim = usc.simulate(TinyLlama(), "dp=2", example_inputs=BATCHES[0])
    with pytest.raises(usc.CheckpointError, match="AdamW .*SGD"):
        sim.load(path)


def test_a_slow_write_times_out_as_a_collective_error(tmp_path, monkeypatch):
    sim = _trained("dp=2 timeout=1", steps=1)
    original = checkpoint.write_pieces

    def slow(directory, rank, pieces):
        if rank == 1:
            time.sleep(4)
        return original(directory, rank, pieces)

    monkeypatch.setattr(checkpoint, "write_pieces", slow)
    with pytest.raises(usc.CollectiveError):
        sim.save(tmp_path / "ckpt")


# ----------------------------------------------------------------------------- gloo
def _save_on_gloo(rank, world_size, plan, path):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    step = usc.compile(TinyLlama(), plan, example_inputs=BATCHES[0])
    losses = [step.step(*b) for b in BATCHES[:2]]
    step.save(path)
    return losses


@pytest.mark.distributed
def test_gloo_sharded_save_loads_under_pipeline_plan(tmp_path):
    path = str(tmp_path / "ckpt")
    run_world(_save_on_gloo, 4, "dp=2 tp=2 zero=3", path, timeout=240)
    assert sorted(f for f in os.listdir(path) if f.endswith(".pt")) == [f"rank{r:05d}.pt" for r in range(4)]
    _continue_equals_one_device(path, "pp=2 tp=2")


def test_a_background_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path, monkeypatch):
    sim = _trained("dp=2 tp=2 zero=2", steps=2)
    at_save = _state(sim)
    original, seen = checkpoint.write_pieces, []

    def slow(*args):
        time.sleep(0.5)  # still writing when the next step starts
        seen.append(sim.ranks[0].steps_done)
        return original(*args)

    monkeypatch.setattr(checkpoint, "write_pieces", slow)
    sim.save(tmp_path / "ckpt", background=True)
    assert not (tmp_path / "ckpt").exists()  # not committed yet
    sim.step(*BATCHES[2])  # the pieces were copied: this step's update is not in the checkpoint
    assert (tmp_path / "ckpt" / ".metadata").exists() and len(seen) == 4  # every rank wrote
    _assert_loads(tmp_path / "ckpt", at_save)
    _continue_equals_one_device(tmp_path / "ckpt", "pp=2 mb=2")


@pytest.mark.parametrize("plan_a, plan_b", [("dp=2 ep=2", "dp=1"), ("dp=4 ep=2 tp=2", "dp=2 ep=2 pp=2")])
def test_expert_parallel_checkpoints_move_between_plans(tmp_path, plan_a, plan_b):
    from usc.testing.models import TinyDeepSeek

    batches = [token_batch(128, 4, 16, seed=s) for s in range(4)]
    torch.manual_seed(0)
    reference, first = TinyDeepSeek().double(), TinyDeepSeek().double()
    first.load_state_dict(reference.state_dict())
    expected = reference_run(reference, batches, lambda p: torch.optim.AdamW(p))
    run_a = usc.simulate(first, plan_a, example_inputs=batches[0])
    losses = [run_a.step(*b) for b in batches[:2]]
    run_a.save(tmp_path / "ckpt")
    torch.manual_seed(1)
    run_b = usc.simulate(TinyDeepSeek().double(), plan_b, example_inputs=batches[0])
    run_b.load(tmp_path / "ckpt")
    losses += [run_b.step(*b) for b in batches[2:]]
    assert losses == pytest.approx(expected, rel=1e-10)
    worst, _ = compare_states(run_b.full_state_dict(), reference.state_dict(), atol=1e-9)
    assert worst <= 1e-9
