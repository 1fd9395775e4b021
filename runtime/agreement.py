"""Ranks agree before they train: one small exchange of fingerprints at the first step.

Ranks that were launched differently train silently wrong: another seed (dp replicas that differ, of
which a save keeps rank 0's), a plan with dtype=bf16 on one rank only, other batch shapes, another
torch, or a rank of another job that found this one's port. Each rank therefore hashes what it was
built from (``fingerprint``: the job id, the plan, the model's structure and a bit-exact checksum of
its parameters and buffers, the dtypes, the batch shapes, the versions, and the program it compiled)
into one int64 per field, and
``agree`` gathers every rank's row with one all-gather per mesh axis (the rows gathered on one axis
travel on along the next, so every rank ends with all of them). Every rank then holds the same table
and raises the same ``RanksDisagree``, naming the fields that differ and which ranks hold which value.

Each rank compiles its own program, so two ranks built alike must also have compiled alike: a compile
that read something differing between processes (an order over objects' addresses, an environment
variable) would otherwise leave ranks issuing their collectives in different orders -- a hang, or a
sum of the wrong tensors. The program's hash (``Program.listing``, compiler/program.py) is a field too.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

# Where a launcher names its job; the first one set is the job id (USC_JOB_ID: set it yourself when
# your launcher names none, so that a rank of another job on the same port is refused).
JOB_ID_VARIABLES = ("USC_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")

# Fields whose readable value the error shows (a checksum's text says nothing to a reader).
SHOWN = ("job", "plan", "batch shapes", "versions")

# The program is the one field that can differ between ranks launched alike: the trace or the compile
# read something that differs between processes, which a relaunch does not mend.
PROGRAM = "compiled program"
PROGRAM_FIX = ("fix: the same plan, model and batch compiled to different programs on these ranks: the model's "
               "forward or the compile read something that differs between processes (the rank, an environment "
               "variable, an order of objects by address; within usc's passes, a defect to report). To find it, "
               "write each rank's `step.program.listing()` to a file and compare them: the first line that "
               "differs names the node")


class RanksDisagree(RuntimeError):
    """The ranks of one mesh were built from different jobs, plans, models, weights, dtypes, batch shapes or
    versions, or compiled different programs. Every rank raises it at the first step, before anything trains."""

    def __init__(self, message: str, differing: dict[str, list[list[int]]]) -> None:
        super().__init__(message)
        self.differing = differing  # field -> the groups of ranks holding each value


@dataclass(frozen=True)
class Fingerprint:
    """What one rank was built from: field -> readable text (checksums as hex)."""

    fields: dict[str, str]

    def digest(self) -> list[int]:
        """One non-negative int64 per field (the first 63 bits of its SHA-256)."""
        return [int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
                for text in self.fields.values()]


def job_id() -> str:
    return next((os.environ[v] for v in JOB_ID_VARIABLES if os.environ.get(v) not in (None, "", "none")), "")


def fingerprint(*, plan: str, state: Mapping[str, torch.Tensor], inputs: Sequence, versions: str,
                program: str = "") -> Fingerprint:
    """This rank's fingerprint; `state` is the full model state it was materialised from, `inputs` the
    program's input specs (global shapes and dtypes), `versions` the software it runs, `program` the
    compiled program as ``Program.listing`` writes it."""
    structure = ";".join(f"{name}:{tuple(t.shape)}:{t.dtype}" for name, t in sorted(state.items()))
    shapes = ", ".join(f"{list(s.global_shape)} {s.dtype}" for s in inputs)
    return Fingerprint({
        "job": job_id() or "(none named)",
        "plan": plan,
        "model structure and dtypes": structure,
        "parameter checksum": "".join(_checksum(t) for _, t in sorted(state.items())),
        "batch shapes": shapes,
        "versions": f"{versions}, torch {torch.__version__}, python {platform.python_version()}",
        PROGRAM: hashlib.sha256(program.encode()).hexdigest()[:16],
    })


CHUNK_WORDS = 1 << 22  # the checksum reads a tensor in pieces of 16 MiB (its int64 copy: 4x that)


def _checksum(t: torch.Tensor) -> str:
    """A bit-exact checksum of a tensor's bytes (position-weighted integer sums: no float rounding, so
    ranks with other thread counts agree); a tensor without data (meta) counts by its shape alone."""
    if t.is_meta:
        return "m"
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = torch.nn.functional.pad(raw, (0, -raw.numel() % 4)).view(torch.int32)
    total = 0
    for start in range(0, words.numel(), CHUNK_WORDS):
        piece = words[start:start + CHUNK_WORDS].to(torch.int64)
        weights = torch.arange(start, start + piece.numel(), device=piece.device) % 65521 + 1
        total += int((piece * weights).sum())
    return f"{total & (2**64 - 1):016x}"


def agree(mesh, mine: Fingerprint) -> None:
    """Gather every rank's fingerprint (one all-gather per mesh axis) and raise RanksDisagree on every rank
    when any field differs between any two ranks."""
    rows = torch.tensor([[mesh.rank, *mine.digest()]], dtype=torch.int64, device=mesh.device)
    for axis in mesh.axes:
        if mesh.size(axis) > 1:
            rows = mesh.comm(axis).all_gather(rows, 0)
    table = {int(row[0]): [int(v) for v in row[1:]] for row in rows.cpu()}
    differing = _differing(list(mine.fields), table)
    if differing:
        raise RanksDisagree(_message(mesh.rank, mine, differing), differing)


def _differing(fields: list[str], table: dict[int, list[int]]) -> dict[str, list[list[int]]]:
    out = {}
    for i, field in enumerate(fields):
        groups: dict[int, list[int]] = {}
        for rank in sorted(table):
            groups.setdefault(table[rank][i], []).append(rank)
        if len(groups) > 1:
            out[field] = sorted(groups.values())
    return out


def _message(rank: int, mine: Fingerprint, differing: dict[str, list[list[int]]]) -> str:
    lines = [f"rank {rank}: the ranks of this mesh were not built alike; nothing was trained."]
    for field, groups in differing.items():
        split = " vs ".join(f"ranks {g}" for g in groups)
        shown = f" (rank {rank} has: {mine.fields[field]})" if field in SHOWN else ""
        if field == PROGRAM and len(differing) > 1:
            shown = " (which the fields above may explain)"
        lines.append(f"  {field} differs: {split}{shown}")
    if list(differing) == [PROGRAM]:
        lines.append(PROGRAM_FIX)
    else:
        lines.append("fix: launch every rank from the same script, plan, seed and environment (one job id, "
                     f"set in {JOB_ID_VARIABLES[0]} when your launcher names none)")
    return "\n".join(lines)
