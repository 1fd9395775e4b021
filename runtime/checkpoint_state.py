"""A rank's side of sharded checkpoints (runtime/checkpoint.py holds the format): which pieces of
which global tensors this rank writes, how it takes its own region back under any plan, and the
save's synchronisation through usc's comm.

What a rank holds, and writes, for a state tensor with layout ``placements``:
- its region of the global tensor (``layout.local_box``), written by coordinate 0 of the axes the
  tensor is replicated on (the rule the clipping norm uses: every element once);
- ZeRO-3: its dp slice of that region (a flat range), written by every dp rank;
- ZeRO-1/2 optimizer state: the part of each parameter in this rank's slice of the bucket.
Nothing is gathered: no rank holds, while saving, more than its own share.
"""

from __future__ import annotations

import contextlib
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as fmt  # by module: a test injects faults into each step of the save
from .checkpoint import CheckpointError, Piece, Reader, staging_dir, write_timeout
from .layout import local_box
from .reducer import pad_to_multiple
from .training import slice_pieces
from .zero import ZeroOptimizer
from .zero3 import shard_of

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}


@dataclass(frozen=True)
class LoadResult:
    """What a load did not match (empty after a strict load): tensor names."""

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()


class ShardedCheckpoint:
    """Mixed into RankExecutor: ``checkpoint_pieces`` (save), ``load_from`` (load)."""

    # ------------------------------------------------------------------------------- saving
    def checkpoint_pieces(self) -> list[tuple[Piece, torch.Tensor]]:
        """This rank's pieces of every tensor it is the one to write (no collective)."""
        out = []
        for spec in self.program.state:
            if spec.placeholder in self.state:
                out += self._pieces_of(spec, f"model/{spec.name}", self.state[spec.placeholder].detach())
        for spec, key, value, flat in self._optimizer_pieces():
            out += self._pieces_of(spec, f"optim/{spec.name}/{key}", value, flat=flat)
        return out

    def _pieces_of(self, spec, name: str, value: torch.Tensor, *, flat: int | None = None) -> list:
        """``value``: this rank's tensor (ZeRO-3: its dp slice; ``flat``: the element of the
        region where a ZeRO-1/2 slice starts)."""
        if value.dim() == 0:  # a scalar (an optimizer's step): one copy, like a replicated tensor
            free = ("pp", "dp") if flat is not None else ("pp",)  # ZeRO-1/2: the dp rank holding element 0
            first = all(c == 0 for axis, c in zip(self.mesh.axes, self.mesh.coord) if axis not in free)
            counted = first and self._counts(spec, ("dp",) if flat is not None else ())
            return [(Piece(name, (), (), (), None, str(value.dtype)), value)] if counted else []
        offsets, sizes = local_box(spec.global_shape, spec.layout.placements, self.mesh.shape, self.mesh.coord)
        numel = _numel(sizes)
        if flat is None and not spec.zero3:
            return [(Piece(name, spec.global_shape, offsets, sizes, None, str(value.dtype)), value)] \
                if self._counts(spec, ()) else []
        if flat is None:  # ZeRO-3: slice dp-rank of the padded region
            flat = self.mesh.comm("dp").rank * value.numel()
        hi = min(flat + value.numel(), numel)
        if hi <= flat or not self._counts(spec, ("dp",)):
            return []
        piece = Piece(name, spec.global_shape, offsets, sizes, (flat, hi), str(value.dtype))
        return [(piece, value.reshape(-1)[: hi - flat])]

    def _optimizer_pieces(self) -> list[tuple]:
        """(spec, key, tensor, flat start or None) of every optimizer state entry this rank holds."""
        params = self._named_params()
        by_id = {id(p): spec for spec, p in params.values()}
        inner = self.torch_optimizer
        out = [(by_id[id(p)], key, value, None) for p, state in inner.state.items() if id(p) in by_id
               for key, value in state.items() if isinstance(value, torch.Tensor)]
        if isinstance(self.optimizer, ZeroOptimizer):
            out += self._zero_slices(params)
        return out

    def _zero_slices(self, params: dict) -> list[tuple]:
        """ZeRO-1/2: each parameter's part of this rank's slice of its bucket's state."""
        zero, out = self.optimizer, []
        for bucket, master in zip(zero.buckets, zero.masters):
            sizes = [p.numel() for _, p in bucket.params]
            for key, value in zero.inner.state.get(master, {}).items():
                if value.dim() == 0:  # the step count: written with the parameter's first element
                    holders = [(i, s) for i, s, _ in slice_pieces(master.detach(), sizes, zero.comm.rank, zero.comm.size)]
                    out += [(params[bucket.params[i][0]][0], key, value, 0) for i, s in holders if s == 0]
                    continue
                for index, start, piece in slice_pieces(value, sizes, zero.comm.rank, zero.comm.size):
                    out.append((params[bucket.params[index][0]][0], key, piece, start))
        return out

    def checkpoint_meta(self) -> dict:
        inner = self.torch_optimizer
        groups = [{k: v for k, v in g.items() if k != "params" and isinstance(v, (int, float, bool, str, type(None),
                                                                                  list, tuple))}
                  for g in inner.param_groups]
        return {"optimizer": type(inner).__name__, "param_groups": groups, "steps_done": self.steps_done}

    # ------------------------------------------------------------------------------ loading
    def check_structure(self, reader: Reader, *, strict: bool) -> LoadResult:
        """Names and shapes against the model and optimizer; raises unless ``strict=False``
        (shapes must always match). The same on every rank: it reads only the metadata."""
        expected = {f"model/{s.name}": s.global_shape for s in self.program.state}
        saved = {n for n in reader.names if n.startswith("model/")}
        wrong = [f"{n}: {list(reader.shape(n))} in the checkpoint, {list(shape)} in the model"
                 for n, shape in expected.items() if n in saved and tuple(reader.shape(n)) != tuple(shape)]
        if wrong:
            raise CheckpointError(f"checkpoint '{reader.path}' was saved from another model: " + "; ".join(wrong))
        missing, unexpected = sorted(set(expected) - saved), sorted(saved - set(expected))
        optimizer = type(self.torch_optimizer).__name__
        if reader.meta.get("optimizer") != optimizer:
            unexpected += sorted(n for n in reader.names if n.startswith("optim/"))
            missing.append(f"optimizer state of {optimizer} (the checkpoint holds {reader.meta.get('optimizer')})")
        if strict and (missing or unexpected):
            raise CheckpointError(f"checkpoint '{reader.path}' does not match the model: missing {missing or 'nothing'}"
                                  f"; unexpected {unexpected or 'nothing'} (load(..., strict=False) loads what matches)")
        return LoadResult(tuple(missing), tuple(unexpected))

    def load_from(self, reader: Reader, *, strict: bool = True) -> LoadResult:
        """Take this rank's regions of the model and optimizer state (any plan wrote them)."""
        result = self.check_structure(reader, strict=strict)
        for spec in self.program.state:
            if spec.placeholder in self.state and f"model/{spec.name}" in reader.names:
                with torch.no_grad():
                    self.state[spec.placeholder].copy_(self._region(reader, spec, f"model/{spec.name}", spec.dtype))
        if reader.meta.get("optimizer") == type(self.torch_optimizer).__name__:
            self._load_optimizer(reader)
        self.steps_done = int(reader.meta.get("steps_done", 0))
        return result

    def _region(self, reader: Reader, spec, name: str, dtype: torch.dtype) -> torch.Tensor:
        if not reader.shape(name):
            return reader.box(name, (), (), dtype)
        offsets, sizes = local_box(spec.global_shape, spec.layout.placements, self.mesh.shape, self.mesh.coord)
        local = reader.box(name, offsets, sizes, dtype)
        return shard_of(local, self.mesh.comm("dp")) if spec.zero3 else local

    def _load_optimizer(self, reader: Reader) -> None:
        local_state: dict[str, dict[str, torch.Tensor]] = {}
        for name, (spec, _) in self._named_params().items():
            prefix = f"optim/{name}/"
            for tensor in sorted(n for n in reader.names if n.startswith(prefix)):
                dtype = _DTYPES[reader.pieces[tensor][0].dtype]
                key = tensor[len(prefix):]
                local_state.setdefault(name, {})[key] = self._on_device(key, self._region(reader, spec, tensor, dtype))
        self._set_optimizer_state(local_state)
        for group, saved in zip(self.torch_optimizer.param_groups, reader.meta.get("param_groups", [])):
            group.update({k: tuple(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()})

    def _on_device(self, key: str, value: torch.Tensor) -> torch.Tensor:
        """Loaded optimizer state lands where torch keeps it: on the program's device, except
        Adam-style 'step' counters of a non-capturable, non-fused optimizer (the CPU)."""
        groups = self.torch_optimizer.param_groups
        on_host = key == "step" and not any(g.get("capturable") or g.get("fused") for g in groups)
        return value if on_host else value.to(self.device)

    def _set_optimizer_state(self, local_state: dict[str, dict[str, torch.Tensor]]) -> None:
        params = self._named_params()
        if not isinstance(self.optimizer, ZeroOptimizer):
            for name, state in local_state.items():
                self.optimizer.state[params[name][1]] = state
            return
        inner, zero = self.optimizer.inner, self.optimizer
        in_bucket = set()
        for bucket, master in zip(zero.buckets, zero.masters):
            names = [n for n, _ in bucket.params]
            in_bucket.update(names)
            keys = set().union(*(local_state.get(n, {}).keys() for n in names))
            state = {key: _bucket_slice([local_state[n][key] for n in names], zero.comm) for key in keys}
            if state:
                inner.state[master] = state
        for name, state in local_state.items():
            if name not in in_bucket:
                inner.state[params[name][1]] = state


def _bucket_slice(values: list[torch.Tensor], comm) -> torch.Tensor:
    """This rank's slice of a bucket's state from its parameters' (a scalar stays itself)."""
    if values[0].dim() == 0:
        return values[0]
    flat = pad_to_multiple(torch.cat([v.reshape(-1) for v in values]), comm.size)
    size = flat.numel() // comm.size
    return flat[comm.rank * size: (comm.rank + 1) * size].clone()


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


# ------------------------------------------------------------------------------ the save
@contextlib.contextmanager
def _timeout(comms: list, seconds: float):
    """Collectives that wait for a write wait as long as the write may take."""
    before = [c.timeout for c in comms]
    for c in comms:
        c.timeout = max(c.timeout, seconds)
    try:
        yield
    finally:
        for c, t in zip(comms, before):
            c.timeout = t


def _world_reduce(mesh, value: torch.Tensor, op: str = "sum", timeout: float | None = None) -> torch.Tensor:
    """All-reduce over every mesh axis in turn: the whole world's sum (or max)."""
    comms = [mesh.comm(a) for a in mesh.axes if mesh.size(a) > 1]
    value = value.to(mesh.device)  # NCCL reduces device tensors only
    with _timeout(comms, timeout or 0.0):
        for comm in comms:
            value = comm.all_reduce(value, op)
    return value


@dataclass
class PendingSave:
    """A save whose pieces are being written (by a thread when started in the background); ``finish``
    (a collective, on every rank at the same point) agrees that all wrote and commits."""

    rank: object
    target: Path
    staged: Path
    token: int
    timeout: float
    meta: dict
    writer: threading.Thread | None = None
    failure: Exception | None = None

    def write(self, pieces: list) -> None:
        self.failure = _attempt(lambda: (self.staged.mkdir(parents=True, exist_ok=True),
                                         fmt.write_pieces(self.staged, self.rank.mesh.rank, pieces)))

    def finish(self) -> None:
        mesh = self.rank.mesh
        if self.writer is not None:
            self.writer.join()
        _agree(mesh, self.failure, self.timeout, f"rank {mesh.rank} could not write its pieces of '{self.target}'",
               self.staged)
        failure = _attempt(lambda: (fmt.write_metadata(self.staged, mesh.world_size, self.meta),
                                    fmt.commit(self.target, self.staged, self.token))) if mesh.rank == 0 else None
        _agree(mesh, failure, self.timeout, f"rank 0 could not commit '{self.target}'", self.staged)


def start_save(rank, path, meta: dict, *, background: bool = False) -> PendingSave:
    """Every rank of the mesh calls this: agree on the staging directory and the write's timeout, then
    write this rank's pieces — now, or in a thread from a copy of them (this rank's share only) while
    training goes on."""
    mesh, target = rank.mesh, Path(path)
    if isinstance(rank.optimizer, ZeroOptimizer):
        rank.optimizer.exact()  # the weights as their owners hold them, not the compute-dtype gather's
    pieces = rank.checkpoint_pieces()
    if background:  # the next step updates the state in place: write what it is now
        pieces = [(piece, value.detach().clone()) for piece, value in pieces]
    planned = sum(t.numel() * t.element_size() for _, t in pieces)
    token = torch.tensor([secrets.randbits(62) if mesh.rank == 0 else 0, planned], dtype=torch.int64)
    token[0] = _world_reduce(mesh, token[:1].clone())[0]  # rank 0's draw names the staging directory
    most = int(_world_reduce(mesh, token[1:].clone(), "max")[0])
    pending = PendingSave(rank, target, staging_dir(target, int(token[0])), int(token[0]),
                          write_timeout(most, mesh.timeout), meta)
    if background:
        pending.writer = threading.Thread(target=pending.write, args=(pieces,), name="usc-checkpoint-writer",
                                          daemon=True)
        pending.writer.start()
    else:
        pending.write(pieces)
    return pending


def save(rank, path, meta: dict) -> None:
    """Every rank of the mesh calls this: each writes its pieces, rank 0 commits once all did."""
    start_save(rank, path, meta).finish()


def _attempt(fn) -> Exception | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it before anyone raises
        return exc
    return None


def _agree(mesh, failure: Exception | None, timeout: float, what: str, staged: Path) -> None:
    """Every rank learns whether any failed (so none waits for a commit that will not come)."""
    if failure is not None and mesh.rank == 0:
        shutil.rmtree(staged, ignore_errors=True)  # (another rank's failure: the next save cleans it)
    flag = torch.tensor([mesh.rank + 1 if failure else 0], dtype=torch.int64)
    failed = int(_world_reduce(mesh, flag, "max", timeout=timeout)[0])  # the last failing rank + 1
    if failure is not None:
        raise CheckpointError(f"{what}: {type(failure).__name__}: {failure}") from failure
    if failed:
        raise CheckpointError(f"rank {failed - 1} could not save the checkpoint (see its error); nothing was "
                              "committed, the previous checkpoint under the name is intact")
