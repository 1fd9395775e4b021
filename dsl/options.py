"""The vocabulary of the plan language: mesh axes, options with their value domains, rule actions.

Each option is one row of :data:`OPTIONS` (type, allowed values, default, one-line doc); the parser, the
dataclasses and ``Plan.__str__`` all read and write values through the row's :class:`ValueKind`, so a new
option is one new row and nothing else.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .errors import Problem, did_you_mean

AXES: tuple[str, ...] = ("dp", "tp", "pp", "cp", "ep")
"""Mesh axes: data, tensor, pipeline, context and expert parallel. Written order = outermost first."""

_WHOLE = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?", re.ASCII)
_MODULE_PATH = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", re.ASCII)
# int() refuses strings past sys.get_int_max_str_digits() with a ValueError; no mesh is that large.
_MAX_DIGITS = 18


class ValueKind:
    """How one option's value is read from text, checked when given as a Python value, and written."""

    def parse(self, name: str, text: str) -> Any:
        """The value written as ``name=text``; raises :class:`Problem` when it is not allowed."""
        raise NotImplementedError

    def check(self, name: str, value: Any) -> Any:
        """``value`` (already a Python value) normalized, or :class:`Problem` when not allowed."""
        raise NotImplementedError

    def format(self, value: Any) -> str:
        """The plan text for ``value``; ``parse(format(v)) == v``."""
        return str(value)

    def coerce(self, name: str, value: Any) -> Any:
        """Accept either plan text (``"on"``, ``"0.5"``) or a Python value (``True``, ``0.5``)."""
        return self.parse(name, value) if isinstance(value, str) else self.check(name, value)


def whole_number(text: str) -> int | None:
    """``text`` as an int if it is written as one in ASCII digits ('２' and '1_000' are not), else None."""
    if not _WHOLE.fullmatch(text) or len(text.lstrip("+-")) > _MAX_DIGITS:
        return None
    return int(text)


@dataclass(frozen=True)
class WholeNumber(ValueKind):
    """An integer in ``lo..hi`` (``hi`` None: no upper bound)."""

    lo: int
    hi: int | None = None

    def parse(self, name: str, text: str) -> int:
        number = whole_number(text)
        if number is None and _WHOLE.fullmatch(text):
            raise Problem(f"{name}={text} is too large", f"{name} must be {self.describe()}")
        if number is None:
            raise Problem(f"expected a whole number after '{name}=', got '{text}'", self._example(name))
        return self.check(name, number)

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Problem(f"{name} must be a whole number, got {value!r}", self._example(name))
        if value < self.lo or (self.hi is not None and value > self.hi):
            raise Problem(f"{name} must be {self.describe()}, got {value}")
        return value

    def describe(self) -> str:
        return f"{self.lo}..{self.hi}" if self.hi is not None else f"at least {self.lo}"

    def _example(self, name: str) -> str:
        return f"write e.g. {name}={max(self.lo, 2) if self.hi is None else self.lo}"


@dataclass(frozen=True)
class PositiveNumber(ValueKind):
    """A finite number > 0, integer or decimal (``0.5``, ``25``, ``1e-3``); stored as float."""

    def parse(self, name: str, text: str) -> float:
        if not _NUMBER.fullmatch(text):
            raise Problem(f"expected a number after '{name}=', got '{text}'", f"write e.g. {name}=0.5")
        return self.check(name, float(text))

    def check(self, name: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise Problem(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise Problem(f"{name} must be a number > 0, got {value}")
        return float(value)

    def format(self, value: float) -> str:
        # 25.0 prints as '25' (how people write it); repr keeps every other float exact.
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else repr(value)

    def describe(self) -> str:
        return "a number > 0"


_BYTES = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)", re.ASCII)
_BYTE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


@dataclass(frozen=True)
class ByteSize(ValueKind):
    """A size in bytes written with its unit (``80GB``, ``40GiB``, ``512MiB``, ``1.5TB``); stored as an
    int of bytes, written back in the largest binary or decimal unit that keeps it whole."""

    def parse(self, name: str, text: str) -> int:
        match = _BYTES.fullmatch(text)
        if not match:
            raise Problem(f"expected a size with a unit after '{name}=', got '{text}'",
                          f"write e.g. {name}=80GB or {name}=40GiB (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)")
        return self.check(name, round(float(match.group(1)) * _BYTE_UNITS[match.group(2)]))

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Problem(f"{name} must be a whole number of bytes, got {value!r}", f"write e.g. {name}=80GB")
        if value < 1:
            raise Problem(f"{name} must be at least 1B, got {value}")
        return value

    def format(self, value: int) -> str:
        for unit in ("TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB"):
            if value % _BYTE_UNITS[unit] == 0:
                return f"{value // _BYTE_UNITS[unit]}{unit}"
        return f"{value}B"

    def describe(self) -> str:
        return "a size such as 80GB or 40GiB"


@dataclass(frozen=True)
class Choice(ValueKind):
    """One word out of a fixed list."""

    words: tuple[str, ...]

    def parse(self, name: str, text: str) -> str:
        if text not in self.words:
            hint = did_you_mean(text, self.words, otherwise=f"{name} is one of {self.describe()}")
            raise Problem(f"unknown {name} '{text}'", hint)
        return text

    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str):
            raise Problem(f"{name} must be one of {self.describe()}, got {value!r}")
        return self.parse(name, value)

    def describe(self) -> str:
        return "|".join(self.words)


@dataclass(frozen=True)
class NameOrFile(Choice):
    """One word out of a fixed list, or the path of a file with one of ``suffixes`` (a hardware
    profile a user wrote or a calibration measured); whether the file exists is checked on use."""

    suffixes: tuple[str, ...] = (".toml", ".json")

    def parse(self, name: str, text: str) -> str:
        if text.lower().endswith(self.suffixes):
            return text
        return super().parse(name, text)

    def describe(self) -> str:
        return super().describe() + "|FILE" + "|FILE".join(self.suffixes)


@dataclass(frozen=True)
class Switch(ValueKind):
    """``on`` or ``off``; stored as a bool so ``if plan.get("sp"):`` reads naturally."""

    def parse(self, name: str, text: str) -> bool:
        if text not in ("on", "off"):
            raise Problem(f"{name} must be on or off, got '{text}'", f"write {name}=on or {name}=off")
        return text == "on"

    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise Problem(f"{name} must be True/False or 'on'/'off', got {value!r}")
        return value

    def format(self, value: bool) -> str:
        return "on" if value else "off"

    def describe(self) -> str:
        return "on|off"


@dataclass(frozen=True)
class SplitPoints(ValueKind):
    """``auto``, or module paths separated by '|' where the pipeline is cut: a tuple of str."""

    def parse(self, name: str, text: str) -> str | tuple[str, ...]:
        return "auto" if text == "auto" else self.check(name, tuple(text.split("|")))

    def check(self, name: str, value: Any) -> str | tuple[str, ...]:
        if value == "auto":
            return "auto"
        if not isinstance(value, (tuple, list)) or not value or not all(isinstance(p, str) for p in value):
            raise Problem(f"{name} must be 'auto' or module paths, got {value!r}")
        for path in value:
            if not _MODULE_PATH.fullmatch(path):
                raise Problem(
                    f"'{path}' is not a module path in {name}", f"write e.g. {name}=layers.4|layers.8"
                )
        if len(set(value)) != len(value):
            raise Problem(f"{name} lists a module path twice")
        return tuple(value)

    def format(self, value: str | tuple[str, ...]) -> str:
        return value if value == "auto" else "|".join(value)

    def describe(self) -> str:
        return "auto|<path>|<path>..."


@dataclass(frozen=True)
class OptionSpec:
    """One row of the option table."""

    name: str
    kind: ValueKind
    default: Any
    doc: str


def _table(*specs: OptionSpec) -> MappingProxyType:
    return MappingProxyType({spec.name: spec for spec in specs})


OPTIONS = _table(
    OptionSpec("zero", WholeNumber(0, 3), 0, "ZeRO stage: 0 none, 1 optimizer state, 2 +grads, 3 +params"),
    OptionSpec("mb", WholeNumber(1), 1, "microbatches per step (pipeline and gradient accumulation)"),
    OptionSpec(
        "schedule",
        Choice(("gpipe", "1f1b", "interleaved", "zb", "dualpipe")),
        "1f1b",
        "pipeline schedule",
    ),
    OptionSpec("v", WholeNumber(1), 1, "virtual pipeline stages per rank (interleaved schedules)"),
    OptionSpec("recompute", Choice(("none", "selective", "full")), "none", "activation recomputation"),
    OptionSpec("sp", Switch(), False, "sequence parallelism for norms/dropout inside the tp group"),
    OptionSpec("cp_mode", Choice(("ring", "zigzag", "ulysses")), "ring", "context-parallel attention"),
    OptionSpec("dtype", Choice(("fp32", "bf16")), "fp32", "compute dtype"),
    OptionSpec("reduce_dtype", Choice(("fp32", "bf16")), "fp32", "dtype of the gradient reduction over dp"),
    OptionSpec("fuse", Switch(), False, "fuse elementwise chains into generated kernels"),
    OptionSpec("gpus_per_node", WholeNumber(1), 8, "ranks per node: the innermost axes stay within a node"),
    OptionSpec("bucket_mb", PositiveNumber(), 25.0, "gradient all-reduce bucket size in MiB"),
    OptionSpec("split", SplitPoints(), "auto", "pipeline cut points: auto, or module paths 'a|b'"),
    OptionSpec("timeout", PositiveNumber(), 300.0, "collective timeout in seconds"),
    OptionSpec("replica_check", WholeNumber(0), 0, "every N steps compare replicated parameters and buffers "
                                                    "across peers; raise on the first that differs (0: off)"),
    OptionSpec("seed", WholeNumber(0), 0, "seed of usc's counter-based random draws (dropout, rand)"),
    OptionSpec("batch_coupling", Choice(("refuse", "per_microbatch")), "refuse",
               "mb>1 and a loss term coupling the batch: refuse, or define it per microbatch (Megatron)"),
    OptionSpec("capacity_factor", PositiveNumber(), None, "MoE expert capacity factor (None: no limit)"),
    OptionSpec("gpus", WholeNumber(1), None, "auto: ranks to plan for (default: the launch's world size)"),
    OptionSpec("seq", WholeNumber(1), None, "auto: sequence length to plan for (default: the example's)"),
    OptionSpec("global_batch", WholeNumber(1), None, "auto: sequences per step (default: the example's)"),
    OptionSpec("hardware", NameOrFile(("h100", "a100")), "h100",
               "auto: the GPU the cost model assumes (a built-in name or a profile file)"),
    OptionSpec("memory", ByteSize(), None, "device memory per rank the automatic pipeline split must fit "
                                           "(default: the written hardware's, or the CUDA device's)"),
)
"""Every option: ``OPTIONS[name].kind`` reads/checks/writes the value, ``.default`` when not written."""

AXIS_SIZE = WholeNumber(1)
"""Value kind of every mesh axis size."""


@dataclass(frozen=True)
class ActionSpec:
    """One action a rule may apply; ``arg`` is the kind of its argument, None when it takes none."""

    name: str
    arg: WholeNumber | None
    doc: str


ACTIONS = MappingProxyType(
    {
        spec.name: spec
        for spec in (
            ActionSpec("colwise", None, "shard the weight's output features over tp (Megatron column)"),
            ActionSpec("rowwise", None, "shard the weight's input features over tp (Megatron row)"),
            ActionSpec("vocab", None, "shard an embedding / lm_head over the vocabulary"),
            ActionSpec("replicate", None, "keep a full copy on every tp rank"),
            ActionSpec("expert", None, "distribute experts over ep"),
            ActionSpec("recompute", None, "recompute this module's activations in backward"),
            ActionSpec("stage", WholeNumber(0), "place this module on pipeline stage N"),
        )
    }
)
"""Every rule action; only ``stage`` takes an argument, ``stage(N)`` with N >= 0."""
TP_ACTIONS = ("colwise", "rowwise", "vocab", "replicate")
"""The actions that say how tp splits a module's weight (the last matching rule with one wins)."""


def setting_names() -> tuple[str, ...]:
    """Everything that may stand left of '=': axes then options (for suggestions)."""
    return AXES + tuple(OPTIONS)
