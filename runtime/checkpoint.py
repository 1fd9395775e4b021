"""Sharded checkpoints: every rank writes only what it holds; a rank of any other plan reads only
the pieces that overlap what it will hold.

A checkpoint is a directory:

    rank00003.pt     this rank's pieces (``torch.save`` of a dict of tensors, read back with
                     ``torch.load(weights_only=True, mmap=True)``: only the pieces touched are read)
    rank00003.json   this rank's manifest: the file's CRC-32 and, for each piece, the global tensor
                     it belongs to, the box of that tensor it covers (offsets and sizes per dim), the
                     range of that box's flattened elements it holds (ZeRO slices), its dtype and a
                     CRC-32 of its bytes
    .metadata        written last, by rank 0: every manifest, the run's metadata (plan, optimizer
                     class, param groups, scheduler state, step) and a CRC-32 of itself

Every copy of a replicated tensor is written once (by coordinate 0 of the axes it is replicated
on; a pipeline weight by the rank owning it), so the pieces tile each tensor exactly.

The commit is atomic at every instant: pieces go to ``.NAME.tmp-<id>``; when every rank has
written (an all-reduce of failures through usc's own comm, with a timeout sized for the write),
rank 0 writes ``.metadata`` and renames: NAME -> ``.NAME.old-<id>``, tmp -> NAME, then removes the
old copy and any stale tmp/old directories. A crash between the two renames leaves NAME absent and
both complete copies beside it: the loader takes the newest complete one.

Every failure is a ``CheckpointError`` (an ``Exception``) naming the file: a flipped byte (its
piece's CRC), a missing or truncated file, a foreign or damaged ``.metadata``, tensors the model
has and the checkpoint lacks or the other way round, another optimizer's state.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

FORMAT = "usc-sharded-1"
METADATA = ".metadata"

# Seconds a save may take beyond the plan's collective timeout, per byte a rank writes: a
# pessimistic 20 MB/s (a busy network filesystem), so a slow write is not mistaken for a dead peer.
WRITE_SECONDS_PER_BYTE = 1 / 20e6


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, damaged or does not match the model."""


@dataclass(frozen=True)
class Piece:
    """A part of one global tensor: its box (offsets, sizes) and, for a ZeRO slice, the range
    [flat_lo, flat_hi) of that box's row-major elements it holds."""

    tensor: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat: tuple[int, int] | None
    dtype: str
    file: str = ""
    key: str = ""
    crc: int = 0

    @staticmethod
    def of(record: dict) -> "Piece":
        return Piece(record["tensor"], tuple(record["shape"]), tuple(record["offsets"]), tuple(record["sizes"]),
                     tuple(record["flat"]) if record["flat"] is not None else None, record["dtype"],
                     record["file"], record["key"], record["crc"])


def crc_of(t: torch.Tensor) -> int:
    """CRC-32 of a tensor's bytes (read in place: no copy of a contiguous tensor)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return zlib.crc32(memoryview(data.numpy()))


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: a slice of a larger buffer is copied out first
    (the copy is this rank's own share, never more)."""
    t = t.detach()
    if t.is_contiguous() and t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------ writing
def rank_file(rank: int) -> str:
    return f"rank{rank:05d}"


def write_pieces(directory: Path, rank: int, pieces: Sequence[tuple[Piece, torch.Tensor]]) -> int:
    """Write this rank's pieces and manifest into ``directory``; returns the bytes written."""
    name = rank_file(rank)
    tensors, records = {}, []
    for index, (piece, value) in enumerate(pieces):
        key = f"p{index}"
        tensors[key] = _own_storage(value).cpu()
        records.append(asdict(Piece(**{**asdict(piece), "file": f"{name}.pt", "key": key,
                                       "crc": crc_of(tensors[key])})))
    _write_durably(directory / f"{name}.pt", lambda f: torch.save(tensors, f))
    manifest = {"file": f"{name}.pt", "crc": file_crc(directory / f"{name}.pt"), "pieces": records}
    _write_durably(directory / f"{name}.json", lambda f: f.write(json.dumps(manifest).encode()))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def file_crc(path: Path, chunk: int = 1 << 22) -> int:
    """CRC-32 of a whole file, read in chunks (torch.save's zip has bytes outside every tensor:
    headers and alignment padding, which the pieces' own CRCs do not cover)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _write_durably(path: Path, write: Callable) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_metadata(directory: Path, world: int, meta: dict) -> None:
    """Rank 0, after every rank wrote: ``.metadata`` from the manifests (the completeness mark)."""
    pieces, files = [], {}
    for rank in range(world):
        manifest = directory / f"{rank_file(rank)}.json"
        if not manifest.exists():
            raise CheckpointError(f"rank {rank} reported its pieces written but '{manifest}' is missing")
        entry = json.loads(manifest.read_text())
        pieces += entry["pieces"]
        files[entry["file"]] = entry["crc"]
    body = json.dumps({"format": FORMAT, "time": time.time(), "world": world, "meta": meta, "files": files,
                       "pieces": pieces})
    text = f"{zlib.crc32(body.encode())}\n{body}"
    _write_durably(directory / f"{METADATA}.part", lambda f: f.write(text.encode()))
    os.replace(directory / f"{METADATA}.part", directory / METADATA)


def staging_dir(target: Path, token: int) -> Path:
    return target.with_name(f".{target.name}.tmp-{token:016x}")


def commit(target: Path, staged: Path, token: int) -> None:
    """Put a complete staged checkpoint under ``target``: at every instant a complete checkpoint
    exists under the name or (between the renames) beside it, where ``resolve`` finds it."""
    old = target.with_name(f".{target.name}.old-{token:016x}")
    if target.exists():
        os.rename(target, old)
    os.rename(staged, target)
    _sync_dir(target.parent)
    shutil.rmtree(old, ignore_errors=True)
    for stale in _siblings(target):
        shutil.rmtree(stale, ignore_errors=True)


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _siblings(target: Path) -> list[Path]:
    """Staged or superseded copies of ``target`` left by an earlier save that did not finish."""
    prefixes = (f".{target.name}.tmp-", f".{target.name}.old-")
    if not target.parent.exists():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefixes))


def write_timeout(nbytes: int, base: float) -> float:
    return base + nbytes * WRITE_SECONDS_PER_BYTE


# ------------------------------------------------------------------------------------ reading
def resolve(path: str | os.PathLike) -> Path:
    """The directory to load: ``path`` itself, or when a crash between the two renames of a save
    left no directory under the name, the newest complete copy beside it."""
    target = Path(path)
    if target.exists():
        return target
    complete = []
    for candidate in _siblings(target):
        try:
            complete.append((_read_metadata(candidate)["time"], candidate))
        except CheckpointError:
            continue  # a save that stopped before its metadata: not a checkpoint
    if not complete:
        raise CheckpointError(f"no checkpoint at '{target}'")
    return max(complete)[1]


def _read_metadata(directory: Path) -> dict:
    path = directory / METADATA
    if not path.exists():
        raise CheckpointError(f"'{directory}' is not a complete checkpoint: its '{METADATA}' file is missing")
    raw = path.read_bytes()
    head, _, body = raw.partition(b"\n")
    try:
        expected = int(head)
    except ValueError:
        raise CheckpointError(f"'{path}' is not a usc checkpoint's metadata (damaged, or another format)") from None
    if zlib.crc32(body) != expected:
        raise CheckpointError(f"'{path}' is damaged: its checksum does not match (truncated or changed)")
    header = json.loads(body)
    if header.get("format") != FORMAT:
        raise CheckpointError(f"'{path}' has format {header.get('format')!r}; this usc reads {FORMAT!r}")
    return header


class Reader:
    """The pieces of a checkpoint by tensor; ``box`` assembles any region from the pieces that
    overlap it, opening only the files that hold them (memory-mapped). A file is checked whole
    (CRC-32) when first opened, and each piece again as it is read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = resolve(path)
        header = _read_metadata(self.path)
        self.meta: dict = header["meta"]
        self.pieces: dict[str, list[Piece]] = {}
        for record in header["pieces"]:
            piece = Piece.of(record)
            self.pieces.setdefault(piece.tensor, []).append(piece)
        self.file_crcs: dict[str, int] = header["files"]
        for file in sorted(self.file_crcs):
            if not (self.path / file).exists():  # a stat per file: a lost file is named before anything loads
                raise CheckpointError(f"checkpoint '{self.path}' is missing the piece file '{file}'; it cannot be loaded")
        self._files: dict[str, dict] = {}
        self._checked: set[tuple[str, str]] = set()
        self.bytes_read = 0

    @property
    def names(self) -> set[str]:
        return set(self.pieces)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.pieces[name][0].shape

    def box(self, name: str, offsets: Sequence[int], sizes: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The region [offsets, offsets + sizes) of tensor ``name``."""
        out = torch.empty(tuple(sizes), dtype=dtype)
        covered = 0
        for (src_offsets, src_sizes), group in _by_box(self.pieces.get(name, [])).items():
            overlap = _overlap(src_offsets, src_sizes, offsets, sizes)
            if overlap is None:
                continue
            source = self._whole_box(name, src_sizes, group)
            src, dst = overlap
            out[dst] = source[src].to(dtype)
            covered += out[dst].numel()
        if covered != out.numel():
            raise CheckpointError(f"checkpoint '{self.path}' does not cover {name}[{_describe(offsets, sizes)}] "
                                  f"({covered} of {out.numel()} elements present): a rank's pieces are missing")
        return out

    def _whole_box(self, name: str, sizes: tuple[int, ...], group: list[Piece]) -> torch.Tensor:
        """One saving rank's box, from its piece or its ZeRO slices."""
        if len(group) == 1 and group[0].flat is None:
            return self._tensor(group[0]).view(sizes)
        flat = torch.empty(_numel(sizes), dtype=self._tensor(group[0]).dtype)
        filled = 0
        for piece in group:
            lo, hi = piece.flat
            flat[lo:hi] = self._tensor(piece).reshape(-1)
            filled += hi - lo
        if filled != flat.numel():
            raise CheckpointError(f"checkpoint '{self.path}': the ZeRO slices of '{name}' cover {filled} of "
                                  f"{flat.numel()} elements; a rank's file is missing")
        return flat.view(sizes)

    def _tensor(self, piece: Piece) -> torch.Tensor:
        tensors = self._open(piece.file)
        value = tensors.get(piece.key)
        if value is None:
            raise CheckpointError(f"checkpoint file '{self.path / piece.file}' lacks its piece '{piece.key}' "
                                  f"of '{piece.tensor}'")
        if (piece.file, piece.key) not in self._checked:
            if crc_of(value) != piece.crc:
                raise CheckpointError(f"checkpoint file '{self.path / piece.file}' is damaged: piece '{piece.key}' "
                                      f"of '{piece.tensor}' fails its checksum")
            self._checked.add((piece.file, piece.key))
            self.bytes_read += value.numel() * value.element_size()
        return value

    def _open(self, file: str) -> dict:
        if file not in self._files:
            path = self.path / file
            if not path.exists():
                raise CheckpointError(f"checkpoint '{self.path}' is missing the piece file '{file}'; it cannot "
                                      "be loaded")
            if file_crc(path) != self.file_crcs.get(file):
                raise CheckpointError(f"checkpoint file '{path}' is damaged: its checksum does not match "
                                      "(changed or truncated since it was written)")
            try:  # weights_only: tensors and plain containers, never arbitrary pickled objects
                self._files[file] = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except Exception as exc:  # noqa: BLE001 - name the file, keep the cause
                raise CheckpointError(f"checkpoint file '{path}' cannot be read (truncated or damaged): "
                                      f"{type(exc).__name__}: {exc}") from exc
        return self._files[file]


def _numel(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _by_box(pieces: list[Piece]) -> dict[tuple, list[Piece]]:
    groups: dict[tuple, list[Piece]] = {}
    for piece in pieces:
        groups.setdefault((piece.offsets, piece.sizes), []).append(piece)
    return groups


def _overlap(src_offsets, src_sizes, offsets, sizes) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """(slices into the source box, slices into the target box) of their intersection."""
    src, dst = [], []
    for so, ss, to, ts in zip(src_offsets, src_sizes, offsets, sizes):
        lo, hi = max(so, to), min(so + ss, to + ts)
        if lo >= hi:
            return None
        src.append(slice(lo - so, hi - so))
        dst.append(slice(lo - to, hi - to))
    return tuple(src), tuple(dst)


def _describe(offsets, sizes) -> str:
    return ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes))
