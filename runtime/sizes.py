"""Bytes of a tensor from its shape and dtype, and bytes as a person reads them: the one helper
every stage's memory count and report uses (compiler and passes import runtime, so it lives at the
bottom)."""

from __future__ import annotations

import math

import torch


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor; ``dtype.itemsize`` knows every dtype (bool, complex, float8)."""
    return math.prod(shape) * dtype.itemsize


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units; whole bytes below 1 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"

