"""A fuzzer for silent wrongness: programs built from what breaks compilers, under drawn plans.

A program (``ProgramSpec``) mixes writes through views, random ops, loss reductions, terms that
couple the batch, frozen and tied parameters, and the same tensor passed twice; ``check_program``
trains it on a plan and on one device and returns "equal" or "refused" (usc.PlanError /
usc.CompileError, a clear refusal). Anything else -- different numbers, another exception --
raises. One device is the plain model, or usc's own one-device run when the program draws random
numbers (README, "What equal means").

>>> from hypothesis import given
>>> from usc.testing.fuzz import programs, PLANS, check_program
>>> @given(programs(), st.sampled_from(PLANS))
... def test_no_silent_wrongness(spec, plan):
...     check_program(spec, plan)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

VOCAB, HIDDEN, FFN, BATCH, SEQ = 38, 14, 22, 6, 5  # tp=2 divides vocab/hidden/ffn; batch 6 splits 2 and 3 ways
PLANS = ("dp=1", "dp=2", "tp=2", "mb=2", "mb=3", "pp=2 mb=2", "dp=2 mb=3", "dp=2 tp=2", "tp=2 pp=2 mb=2",
         "pp=2 mb=2 recompute=full", "dp=3 pp=2 mb=2 schedule=gpipe")

# Writes through a view, as reference implementations of scans and attention variants write them.
VIEW_WRITES = {
    "mul_": lambda h: h[:, 0].mul_(3.0),
    "setitem": lambda h: h.__setitem__((Ellipsis, 1, slice(None, 1)), 0.0),
    "copy_": lambda h: h[:, 0].copy_(h[:, 1]),
}
# Ops that mix samples across the batch dim.
COUPLINGS = {
    "softmax": lambda h: h.softmax(0),
    "center": lambda h: h - h.mean(0),
    "cumsum": lambda h: h.cumsum(0),
    "amax": lambda h: h - h.amax(0, keepdim=True),
}
LOSSES = {
    "token_mean": lambda m, z, y: F.cross_entropy(z.flatten(0, 1), y.flatten()),
    "sum": lambda m, z, y: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum"),
    "mean_square": lambda m, z, y: z.pow(2).mean(),
    "max": lambda m, z, y: F.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="none").max(),
    "token_mean+decay": lambda m, z, y: F.cross_entropy(z.flatten(0, 1), y.flatten())
    + 1e-3 * sum((b.up.weight ** 2).sum() for b in m.blocks),
    "sum+mean": lambda m, z, y: 0.01 * z.sum() + z.pow(2).mean(),
}
FROZEN = {"": (), "up": ("blocks.0.up",), "first_stage": ("embed", "blocks.0")}


@dataclass(frozen=True)
class ProgramSpec:
    """What one fuzzed program contains (its repr is the failure report's program)."""

    view_write: str = ""
    dropout: float = 0.0
    gate: bool = False  # a bernoulli mask
    noise: bool = False  # randn_like noise, as router jitter
    coupling: str = ""
    loss: str = "token_mean"
    frozen: str = ""
    tied: bool = False
    same_inputs: bool = False  # example_inputs=(ids, ids): one tensor passed twice
    attention: str = ""  # "causal": scaled_dot_product_attention; "dropout": with dropout_p 0.2 (a random op)
    row_pick: bool = False  # a mask read as mask[arange(B)[:, None], positions], as Hugging Face builds one

    @property
    def random(self) -> bool:
        return bool(self.dropout or self.gate or self.noise or self.attention == "dropout")


class Block(nn.Module):
    def __init__(self, spec: ProgramSpec, first: bool) -> None:
        super().__init__()
        self.spec, self.first = spec, first
        self.up = nn.Linear(HIDDEN, FFN)
        self.down = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spec = self.spec
        if spec.attention:  # one head over the whole width, causal
            q = x.unsqueeze(1)
            x = x + 0.1 * F.scaled_dot_product_attention(q, q, q, is_causal=True,
                                                         dropout_p=0.2 if spec.attention == "dropout" else 0.0)[:, 0]
        h = self.up(x)
        if self.first and spec.view_write:
            VIEW_WRITES[spec.view_write](h)
        h = torch.relu(h)
        if spec.dropout:
            h = F.dropout(h, spec.dropout)
        if spec.gate:
            h = h * torch.bernoulli(torch.full_like(h, 0.8))
        if spec.noise:
            h = h + 0.1 * torch.randn_like(h)
        if self.first and spec.coupling:
            h = COUPLINGS[spec.coupling](h)
        return x + self.down(h)


class FuzzedProgram(nn.Module):
    """Embedding, two residual blocks, a head; forward(tokens, labels) -> the spec's loss."""

    def __init__(self, spec: ProgramSpec) -> None:
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block(spec, i == 0) for i in range(2))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight
        for path in FROZEN[spec.frozen]:
            for p in self.get_submodule(path).parameters():
                p.requires_grad_(False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        if self.spec.row_pick:  # each row of the batch picks its own row of a mask made from the tokens
            rows, positions = torch.arange(tokens.shape[0]), torch.arange(tokens.shape[1])
            keep = (tokens % 3 != 0)[rows.view(-1, 1), positions.view(1, -1)]
            x = x * keep.unsqueeze(-1).to(x.dtype)
        for block in self.blocks:
            x = block(x)
        return LOSSES[self.spec.loss](self, self.head(x), labels)


@st.composite
def programs(draw) -> ProgramSpec:
    """Programs with zero or more of each pattern (most often one or two at a time)."""
    return ProgramSpec(
        view_write=draw(st.sampled_from(["", "", *VIEW_WRITES])),
        dropout=draw(st.sampled_from([0.0, 0.0, 0.2])),
        gate=draw(st.booleans()) and draw(st.booleans()),
        noise=draw(st.booleans()) and draw(st.booleans()),
        coupling=draw(st.sampled_from(["", "", "", *COUPLINGS])),
        loss=draw(st.sampled_from(sorted(LOSSES))),
        frozen=draw(st.sampled_from(sorted(FROZEN))),
        tied=draw(st.booleans()),
        same_inputs=draw(st.booleans()),
        attention=draw(st.sampled_from(["", "", "causal", "dropout"])),
        row_pick=draw(st.booleans()),
    )


def batches(spec: ProgramSpec, steps: int = 2) -> list[tuple]:
    """Token batches; labels with -100 in uneven numbers per row (microbatches count different
    numbers of tokens). The first is ``(ids, ids)`` -- one tensor twice -- when the spec says so."""
    g = torch.Generator().manual_seed(11)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        for row in range(BATCH):
            labels[row, SEQ - row % 3:] = -100
        out.append((tokens, tokens) if spec.same_inputs and step == 0 else (tokens, labels))
    return out


def make(spec: ProgramSpec) -> FuzzedProgram:
    torch.manual_seed(0)
    return FuzzedProgram(spec).double()


def check_program(spec: ProgramSpec, plan: str, *, steps: int = 2) -> str:
    """'equal' or 'refused'; raises AssertionError when the plan trains a different model."""
    import usc
    from usc.testing.equivalence import assert_equivalent

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05)

    try:
        assert_equivalent(lambda: make(spec), plan, batches(spec, steps), optimizer=sgd, rtol=1e-9, atol=1e-9,
                          param_atol=1e-9, reference="usc" if spec.random else "eager")
    except (usc.PlanError, usc.CompileError):
        return "refused"
    except AssertionError as err:
        raise AssertionError(f"{spec} under '{plan}' trains a different model: {err}") from None
    except Exception as err:  # noqa: BLE001 - a crash is neither equal nor a clear refusal
        raise AssertionError(f"{spec} under '{plan}' crashed: {type(err).__name__}: {err}") from err
    return "equal"


__all__ = ["ProgramSpec", "FuzzedProgram", "programs", "batches", "check_program", "PLANS"]
