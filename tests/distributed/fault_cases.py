"""Rank-side functions of the fault tier on gloo (module level, so the harness can pickle them).

``fault_world(rank, world, plan, fault)`` builds TinyLlama on every rank, trains step 1, injects
``fault`` (a bad batch, a rank launched differently, a dead, stuck or interrupted rank), records the
error each rank raised and how long it took, and, where the run can go on, trains step 2 with a good
batch: its loss and state must equal the run that never saw the fault.
"""

from __future__ import annotations

import gc
import io
import os
import signal
import threading
import time

import torch

import usc
from usc.testing.models import TinyLlama, token_batch

VOCAB = 128


class RankReadingLlama(TinyLlama):
    """A forward that reads its process's rank, as a debugging line left in a model might: rank 0
    doubles its loss. Each rank traces its own forward, so rank 0 compiles a program with one more
    multiply; trained, rank 0's gradients would count twice in every dp sum."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        loss = super().forward(tokens, labels)
        return loss * 2.0 if os.environ.get("RANK") == "0" else loss


def sgd(params):
    # SGD with momentum: a step that wrongly went through changes parameters and optimizer state alike
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [token_batch(VOCAB, 4, 16, seed=s) for s in range(2)]


def bad_batch(kind: str, batch: tuple) -> tuple:
    """A batch one device would refuse (or train to NaN on): the bad-input rows of the tier."""
    ids, labels = batch
    if kind == "id out of range":
        ids = ids.clone()
        ids[3, 7] = VOCAB + 3
    elif kind == "label out of range":
        labels = labels.clone()
        labels[1, 5] = -1
    elif kind == "every label ignored":
        labels = torch.full_like(labels, -100)
    elif kind == "float ids":
        ids = ids.float()
    elif kind == "wrong shape":
        ids, labels = ids[:, :12], labels[:, :12]
    elif kind == "empty batch":
        ids, labels = ids[:0], labels[:0]
    return ids, labels


BAD_INPUTS = {  # row -> the error every rank raises
    "id out of range": usc.InputOutOfRange,
    "label out of range": usc.InputOutOfRange,
    "every label ignored": usc.NonFiniteLoss,
    "float ids": usc.InputDtypeError,
    "wrong shape": usc.BadInput,
    "empty batch": usc.BadInput,
}


def nan_on_one_rank(rank_executor) -> None:
    """This rank's loss becomes NaN (its peers' stay finite): the verdict must still be every rank's. A
    pipeline rank's loss is its schedule's token-weighted sum (the last stage's), others' their forward's."""
    name = "_run_schedule" if hasattr(rank_executor, "_run_schedule") else "_loss"
    original = getattr(rank_executor, name)

    def poisoned(*args, **kwargs):
        loss, *rest = original(*args, **kwargs)
        return loss * float("nan"), *rest

    setattr(rank_executor, name, poisoned)


def heal(rank_executor) -> None:
    for name in ("_run_schedule", "_loss"):
        rank_executor.__dict__.pop(name, None)


def _state_bytes(step, rank: int) -> bytes | None:
    """Rank 0's copy of the full state (every rank joins: full_state_dict is a collective)."""
    full = step.full_state_dict()
    if rank != 0:
        return None
    buffer = io.BytesIO()
    torch.save({k: v.detach().clone() for k, v in full.items()}, buffer)
    return buffer.getvalue()


def _launched_differently(rank: int, fault: str, plan: str) -> tuple[int, str, tuple]:
    """(seed, plan, example batch) of this rank: rank 1 differs in the row's one respect."""
    seed, example = 0, batches()[0]
    if rank == 1 and fault == "other seed":
        seed = 1
    if rank == 1 and fault == "other plan":
        plan = f"{plan} dtype=bf16"
    if rank == 1 and fault == "other batch shape":
        example = tuple(t[:, :12] for t in example)
    if fault == "foreign job":
        os.environ["USC_JOB_ID"] = f"job-{'b' if rank == 1 else 'a'}"
    return seed, plan, example


def _add_a_harmless_node(program):
    """A copy of the first input that nothing reads: the program computes the same, but is not the same."""
    gm = program.gm
    first = next(n for n in gm.graph.nodes if n.op == "placeholder")
    last = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    with gm.graph.inserting_after(last):
        gm.graph.call_function(torch.ops.aten.clone.default, (first,))
    return program


def _timed(call) -> tuple[str | None, str, float]:
    start = time.monotonic()
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the row records what was raised, KeyboardInterrupt included
        return type(exc).__name__, str(exc), time.monotonic() - start
    return None, "", time.monotonic() - start


def fault_world(rank: int, world_size: int, plan: str, fault: str) -> dict:
    torch.set_num_threads(1)
    seed, plan, example = _launched_differently(rank, fault, plan)
    torch.manual_seed(seed)
    if rank == 1 and fault == "other program":  # a compile that read something of its process: one more node
        from usc import build

        compile_alike = build.parallelize
        build.parallelize = lambda *a, **k: _add_a_harmless_node(compile_alike(*a, **k))
    model = RankReadingLlama() if fault == "forward reads the rank" else TinyLlama()
    step = usc.compile(model, plan, example_inputs=example, optimizer=sgd)
    good = batches()
    first = _timed(lambda: step.step(*good[0]))
    if first[0] is not None:  # refused before training (ranks launched differently)
        return {"error": first[0], "message": first[1], "seconds": first[2]}
    if fault == "clean":  # the run that never saw a fault
        return {"error": None, "message": "", "seconds": 0.0, "loss": step.step(*good[1]),
                "state": _state_bytes(step, rank)}
    error = _inject(rank, step, fault, good[1])
    out = {"error": error[0], "message": error[1], "seconds": error[2]}
    if fault in BAD_INPUTS or fault == "NaN on one rank":
        out["loss"] = step.step(*good[1])
        out["state"] = _state_bytes(step, rank)
    return out


def _inject(rank: int, step, fault: str, good: tuple) -> tuple[str | None, str, float]:
    if fault in BAD_INPUTS:
        return _timed(lambda: step.step(*bad_batch(fault, good)))
    if fault == "NaN on one rank":
        executor = step._rank()
        if rank == 1:
            nan_on_one_rank(executor)
        result = _timed(lambda: step.step(*good))
        heal(executor)
        return result
    if fault == "killed rank":
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return _timed(lambda: step.step(*good))
    if fault == "stuck rank":
        if rank == 1:
            time.sleep(6)
        return _timed(lambda: step.step(*good))
    if fault == "Ctrl-C while blocked":
        return _interrupted(rank, step, good)
    raise ValueError(f"unknown fault {fault!r}")


def _interrupted(rank: int, step, good: tuple) -> tuple[str | None, str, float]:
    """Rank 0 blocks in the step (rank 1 is late) and gets SIGINT after 1 s; seconds: signal to exit."""
    if rank == 1:
        time.sleep(4)  # rank 0 is gone by now: this rank's step fails at once
        return _timed(lambda: step.step(*good))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # the signal lands wherever this process is: inside a gc callback inherited from the test process
    # (hypothesis times collections) the KeyboardInterrupt is unraisable there, and pytest warns of it
    gc.callbacks.clear()
    sent = {}

    def interrupt():
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(1.0, interrupt).start()
    error, message, _ = _timed(lambda: step.step(*good))
    return error, message, time.monotonic() - sent.get("at", time.monotonic())


def foreign_rank_world(rank: int, world_size: int, plan: str) -> dict:
    """Three processes on one port: job A's ranks 0 and 1, and process 2, rank 1 of job B. A must train
    with its own ranks only; B's rank must wait apart and fail with a LaunchError naming its job."""
    torch.set_num_threads(1)
    foreign = rank == 2
    os.environ.update(RANK="1" if foreign else str(rank), WORLD_SIZE="2",
                      USC_JOB_ID="job-b" if foreign else "job-a")
    if foreign:
        time.sleep(0.5)  # job A's rank 0 hosts the rendezvous by now
    torch.manual_seed(0)
    start = time.monotonic()
    try:  # compile meets the other ranks (it materialises this rank's state)
        step = usc.compile(TinyLlama(), plan, example_inputs=batches()[0], optimizer=sgd)
        losses = [step.step(*b) for b in batches()]
    except BaseException as exc:  # noqa: BLE001 - the row records what the foreign rank raised
        return {"error": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - start}
    return {"error": None, "losses": losses}
