"""Checkpoints written with torch.distributed.checkpoint, readable under any plan.

A checkpoint holds *full* (unsharded) tensors under the model's own state_dict names — the model
state, the optimizer state per parameter, and a little metadata — so a run saved under one plan
(dp=2 tp=2, zero=2 ...) loads under any other: each rank takes its own shard of the full tensors
as it does at compile time. Gathering full tensors costs one model's worth of memory on the
writer while saving; it is the simple, plan-independent choice for now.

Writes go to a temporary directory beside the target that is renamed into place only once it is
complete, so a crash mid-write never leaves something that looks like a checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
import uuid
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

MARKER = "usc_checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the model."""


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write ``tensors`` (+ ``meta``) to ``path`` atomically (temporary directory, then rename)."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    state = {f"t/{name}": t.detach().contiguous() for name, t in tensors.items()}
    state[MARKER] = _encode({"meta": meta, "names": sorted(tensors)})
    try:
        with _quiet():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        if target.exists():
            old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(target, old)
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _encode(value) -> torch.Tensor:
    return torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8)


@contextlib.contextmanager
def _quiet():
    """DCP warns that it runs in one process: that is what we ask of it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def _header(target: Path) -> dict:
    meta = dcp.FileSystemReader(str(target)).read_metadata()
    info = meta.state_dict_metadata.get(MARKER)
    if info is None:
        raise CheckpointError(f"'{target}' was not written by usc (no '{MARKER}' entry)")
    state = {MARKER: torch.empty(info.size, dtype=torch.uint8)}
    with _quiet():
        dcp.load(state, checkpoint_id=str(target), no_dist=True)
    return json.loads(bytes(state[MARKER].tolist()).decode())


def _check_complete(target: Path) -> None:
    if not target.is_dir():
        raise CheckpointError(f"no checkpoint at '{target}' (not a directory)")
    metadata = target / ".metadata"
    if not metadata.exists():
        raise CheckpointError(f"'{target}' is not a complete checkpoint: its '.metadata' file is missing")
    meta = dcp.FileSystemReader(str(target)).read_metadata()
    needed = {}
    for index, info in (meta.storage_data or {}).items():
        needed.setdefault(info.relative_path, index.fqn)
    for relative, example in sorted(needed.items()):
        if not (target / relative).exists():
            raise CheckpointError(f"checkpoint '{target}' is missing the piece '{relative}' (it holds "
                                  f"'{example.removeprefix('t/')}' among others); it cannot be loaded")


def read(path: str | os.PathLike, shapes: dict[str, tuple[torch.Size, torch.dtype]]) -> tuple[dict, dict]:
    """Read a checkpoint written by ``write``: (tensors by name, meta). ``shapes`` says which tensors
    to read and their full shapes; a tensor the checkpoint lacks is a CheckpointError naming it."""
    target = Path(path)
    _check_complete(target)
    header = _header(target)
    names = set(header.get("names", []))
    missing = sorted(set(shapes) - names)
    if missing:
        raise CheckpointError(f"checkpoint '{target}' has no '{missing[0]}'"
                              f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}: "
                              "it was saved from a different model")
    state = {f"t/{name}": torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    try:
        with _quiet():
            dcp.load(state, checkpoint_id=str(target), no_dist=True)
    except Exception as exc:  # noqa: BLE001 - name the checkpoint, keep the cause
        raise CheckpointError(f"could not read checkpoint '{target}': {exc}") from exc
    return {name[2:]: t for name, t in state.items()}, header.get("meta", {})


def read_all(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict]:
    """Every tensor of a checkpoint written by ``write`` (shapes from its metadata), and its meta."""
    target = Path(path)
    _check_complete(target)
    header = _header(target)
    entries = dcp.FileSystemReader(str(target)).read_metadata().state_dict_metadata
    shapes = {}
    for name in header.get("names", []):
        info = entries.get(f"t/{name}")
        if info is None:
            raise CheckpointError(f"checkpoint '{target}' lists '{name}' but holds no data for it")
        shapes[name] = (info.size, info.properties.dtype)
    return read(target, shapes)
