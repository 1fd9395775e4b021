"""Bytes of a tensor from its shape and dtype: the one helper every stage's memory count uses
(compiler and passes import runtime, so it lives at the bottom)."""

from __future__ import annotations

import math

import torch


def shape_bytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor; ``dtype.itemsize`` knows every dtype (bool, complex, float8)."""
    return math.prod(shape) * dtype.itemsize

