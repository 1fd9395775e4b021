"""The training loop's helpers, in the forms PyTorch users know.

    step = usc.compile(model, "dp=2 tp=2", example_inputs=batch,
                       optimizer=usc.training.param_groups(lambda groups: torch.optim.AdamW(groups, lr=3e-4),
                                                           weight_decay=0.1),
                       lr_scheduler=usc.training.warmup_cosine(warmup=100, total=10_000))
    for tokens, labels in loader:
        loss = step.step(tokens, labels, max_grad_norm=1.0)
        print(step.metrics)          # loss, grad_norm, lr, tokens, tokens/s, seconds, peak bytes, mfu

``step.optimizer`` is the torch optimizer that really steps (under ZeRO-1/2 it holds this rank's
slices), ``step.lr_scheduler`` the scheduler; both take ``state_dict()`` and the usual changes.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from usc.runtime.training import GroupedOptimizer, NamedParameters

# Names whose weights take no decay (GPT-2/Llama recipes): biases, every norm, embeddings.
NO_DECAY = ("*bias", "*norm*", "*ln_*", "*embed*", "*wte*", "*wpe*")


@dataclass(frozen=True)
class StepMetrics:
    """What one optimizer step measured (``step.metrics`` after ``step.step``).

    tokens: the global number of tokens the loss averaged over (labels that count); tokens_per_s
    divides it by the step's wall time; grad_norm is the one-device global norm before clipping
    (None when the step neither clipped nor asked for it: pass ``max_grad_norm=float('inf')`` to
    measure only); peak_bytes: CUDA's peak allocated bytes on a GPU, else the bytes of parameters,
    gradients and optimizer state this rank held at the step's peak.

    mfu (model FLOPs utilisation, PaLM's definition): ``flops / (seconds * peak_flops)``. flops: the
    model's FLOPs of the step as the cost model counts them, 3 x (forward matmul and attention
    FLOPs of the global batch: 2 per multiply-add, a causal attention counted whole), recomputation
    not included, nor (as in the cost model) the routed experts of a mixture-of-experts block.
    peak_flops: the hardware profile's peak at the plan's ``dtype`` (fp32 or bf16), per device, times
    the mesh's devices; the profile is ``usc.compile(..., hardware=...)``'s, else the CUDA device's
    when it is a built-in one (found by name), else h100. Elsewhere (a CPU), read ``flops / seconds``
    as the achieved FLOP/s."""

    step: int
    loss: float
    grad_norm: float | None
    lr: float
    tokens: int
    seconds: float
    peak_bytes: int
    flops: float = 0.0
    peak_flops: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def mfu(self) -> float:
        return self.flops / (self.seconds * self.peak_flops) if self.seconds > 0 and self.peak_flops > 0 else 0.0

    def __str__(self) -> str:
        norm = "-" if self.grad_norm is None else f"{self.grad_norm:.3f}"
        return (f"step {self.step:5d}  loss {self.loss:.4f}  grad_norm {norm}  lr {self.lr:.2e}  "
                f"{self.tokens_per_s:,.0f} tok/s  {self.seconds * 1e3:.0f} ms  peak {self.peak_bytes / 2**20:.1f} MiB  "
                f"mfu {self.mfu:.2%}")


class param_groups(GroupedOptimizer):
    """An optimizer factory with weight decay off for names matching ``no_decay`` (fnmatch globs on
    the state_dict names) — how GPT-2/Llama recipes build AdamW.

    ``factory`` receives torch param groups: ``[{"params": [...], "weight_decay": weight_decay},
    {"params": [...], "weight_decay": 0.0}]`` (an empty group is left out).

    >>> opt = param_groups(lambda groups: torch.optim.AdamW(groups, lr=1e-3), weight_decay=0.1)
    >>> opt.group_of("layers.0.norm.weight"), opt.group_of("layers.0.mlp.w1.weight")
    (1, 0)
    """

    def __init__(self, factory: Callable[[list[dict]], torch.optim.Optimizer], *, weight_decay: float,
                 no_decay: Sequence[str] = NO_DECAY) -> None:
        self.factory, self.weight_decay, self.no_decay = factory, weight_decay, tuple(no_decay)

    def group_of(self, name: str) -> int:
        """0: decayed, 1: no decay."""
        return int(any(fnmatch.fnmatchcase(name, pattern) for pattern in self.no_decay))

    def __call__(self, params: NamedParameters) -> torch.optim.Optimizer:
        groups: list[list] = [[], []]
        for param, names in zip(params, params.names):
            kinds = {self.group_of(n) for n in names}
            if len(kinds) > 1:  # the executor buckets by group_of, so a slice never mixes them
                raise ValueError(f"one optimizer parameter holds decayed and non-decayed weights: {names}")
            groups[kinds.pop() if kinds else 0].append(param)
        decays = (self.weight_decay, 0.0)
        return self.factory([{"params": g, "weight_decay": d} for g, d in zip(groups, decays) if g])


def warmup_cosine(*, warmup: int, total: int, min_ratio: float = 0.1) -> Callable:
    """An ``lr_scheduler=`` factory: linear warmup over ``warmup`` steps from lr/warmup to lr, then
    cosine decay to ``min_ratio * lr`` at step ``total`` (held after). A torch LambdaLR, so its
    state_dict goes into checkpoints.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    >>> sched = warmup_cosine(warmup=2, total=4)(opt)
    >>> [round(g["lr"], 3) for g in opt.param_groups]
    [0.5]
    """
    if not 0 <= warmup <= total:
        raise ValueError(f"warmup_cosine needs 0 <= warmup ({warmup}) <= total ({total})")

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
