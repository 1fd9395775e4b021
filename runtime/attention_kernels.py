"""Block attention kernels that return the log-sum-exp, for ring attention (runtime/ring_attention.py).

A ring step attends a block of query rows to a block of keys and merges the result with the other
blocks by log-sum-exp, so it needs, per call, the normalised output and the per-row LSE; its
backward needs the matching backward op, fed the *final* output and LSE of the rows. PyTorch
exposes such pairs as aten ops:

| device | forward -> (out, lse) | backward | dtypes |
|---|---|---|---|
| cpu | `_scaled_dot_product_flash_attention_for_cpu` | `..._for_cpu_backward` | float32, float64 (and half types) |
| cuda | `_scaled_dot_product_efficient_attention` (LSE padded to 32 rows) | `..._efficient_attention_backward` | float32 (and half types) |

`is_causal` in these ops is the top-left causal mask, which ring attention uses only on a square
block of the diagonal (query rows against their own positions), where it is the exact mask.

No kernel pair is trusted blindly: the first use of one (per device type and dtype, per process)
compares it with explicit attention math on a small odd-shaped problem, forward, LSE and all three
gradients, causal and not; a pair that disagrees (or raises) is not used, with a warning, and ring
attention computes its tiles in tensor math instead. Every LSE here is [..., rows, 1].
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

aten = torch.ops.aten


@dataclass(frozen=True)
class AttentionKernel:
    """forward(q, k, v, causal, scale) -> (out, lse); backward(dout, q, k, v, out, lse, causal,
    scale) -> (dq, dk, dv). q, k, v: [B, H, rows|keys, D]."""

    name: str
    forward: Callable
    backward: Callable


def _cpu_forward(q, k, v, causal, scale):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse.unsqueeze(-1)


def _cpu_backward(dout, q, k, v, out, lse, causal, scale):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.squeeze(-1).contiguous(), 0.0, causal, scale=scale)


def _cuda_forward(q, k, v, causal, scale):
    out, lse, _, _ = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    return out, lse[..., : q.shape[-2]].unsqueeze(-1)  # the kernel pads its LSE rows to a multiple of 32


def _cuda_backward(dout, q, k, v, out, lse, causal, scale):
    rows = lse.squeeze(-1)
    rows = torch.nn.functional.pad(rows, (0, -rows.shape[-1] % 32)).contiguous()
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # unused: no dropout
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout.contiguous(), q, k, v, None, out.contiguous(), rows, seed, seed, 0.0,
        [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


KERNELS = {
    "cpu": (AttentionKernel("flash_attention_for_cpu", _cpu_forward, _cpu_backward),
            (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
    "cuda": (AttentionKernel("efficient_attention", _cuda_forward, _cuda_backward),
             (torch.float32, torch.bfloat16, torch.float16)),
}

_checked: dict[tuple[str, torch.dtype], AttentionKernel | None] = {}


def kernel_for(device: torch.device, dtype: torch.dtype) -> AttentionKernel | None:
    """The kernel pair for this device and dtype, once it has passed its check; None: tile math."""
    entry = KERNELS.get(device.type)
    if entry is None or dtype not in entry[1]:
        return None
    if _is_fake(device, dtype):  # shapes only (lint's estimates): the kernels a real run would use
        return entry[0]
    key = (device.type, dtype)
    if key not in _checked:
        kernel, detail = _apart(_verified, entry[0], device, dtype)
        if kernel is None:
            warnings.warn(f"usc: the {entry[0].name} attention kernel on {device.type} {dtype} disagrees with "
                          f"the reference ({detail}); ring attention computes its tiles in tensor math instead",
                          stacklevel=2)
        _checked[key] = kernel
    return _checked[key]


def _apart(fn, *args):
    """Run fn in a thread of its own: the first use is often inside a forward that activation
    checkpointing records (its saved-tensor hooks and recompute stops are per thread), and the check's
    own autograd must neither add tensors to that record nor meet its recompute stop."""
    result: list = []

    def run():
        try:
            result.append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - carried to the caller's thread
            result.append(exc)

    worker = threading.Thread(target=run, name="usc-kernel-check")
    worker.start()
    worker.join()
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


def _is_fake(device: torch.device, dtype: torch.dtype) -> bool:
    """Under FakeTensorMode there are no values to check."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(torch.empty(0, device=device, dtype=dtype), FakeTensor)


def _verified(kernel: AttentionKernel, device: torch.device,
              dtype: torch.dtype) -> tuple[AttentionKernel | None, str]:
    if device.type == "cuda" and device.index is not None:  # the current device is per thread
        torch.cuda.set_device(device)
    try:
        error = max(_check(kernel, device, dtype, causal) for causal in (False, True))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use this kernel
        error, detail = math.inf, f"{type(exc).__name__}: {exc}"
    else:
        detail = f"max error {error:.2e}"
    return (kernel if error <= _TOLERANCE[dtype] else None), detail


_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def _check(kernel: AttentionKernel, device: torch.device, dtype: torch.dtype, causal: bool) -> float:
    """Largest relative error of out, lse, dq, dk, dv against float64 math (odd sizes, rows != 32k)."""
    g = torch.Generator().manual_seed(0)
    rows, keys = (37, 37) if causal else (37, 53)
    q, k, v = (torch.randn(1, 3, n, 16, generator=g, dtype=torch.float64) for n in (rows, keys, keys))
    dout = torch.randn(1, 3, rows, 16, generator=g, dtype=torch.float64)
    scale = 0.3
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, causal, scale)
    args = [t.to(device=device, dtype=dtype) for t in (q, k, v)]
    out, lse = kernel.forward(*args, causal, scale)
    grads = kernel.backward(dout.to(device=device, dtype=dtype), *args, out, lse, causal, scale)
    pairs = [(out, ref_out), (lse, ref_lse)] + list(zip(grads, ref_grads))
    return max(((a.double().cpu() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in pairs)


@torch.enable_grad()  # the first use is inside an autograd.Function's forward (grad off)
def _reference(q, k, v, dout, causal, scale):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    s = (q @ k.transpose(-2, -1)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.exp(s - lse) @ v
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), grads
