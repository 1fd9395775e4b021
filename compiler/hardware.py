"""Hardware profiles: the few numbers of a machine that the cost model turns into seconds.

A profile is a frozen value in SI units (FLOP/s, bytes, bytes/s, seconds). Two are built in
(``h100``: H100 SXM5 80GB in an 8-GPU HGX/DGX node; ``a100``: A100 SXM4 80GB in a DGX A100), each
one file in ``profiles/`` with every number's source; a user copies and edits one, or describes their own in a TOML or JSON file with the same field names::

    # my_cluster.toml  (every field of HardwareProfile; or `base = "h100"` plus the ones that differ)
    name = "h100-roce"
    base = "h100"
    inter_node_bandwidth = 25e9     # bytes/s per GPU, one direction
    inter_node_latency = 15e-6

    >>> from usc.compiler.hardware import hardware_profile
    >>> hardware_profile("h100").gpus_per_node
    8

Bandwidths are per GPU and per direction (what one rank can push to its peers at once), which is
what ring/tree collective formulas divide by (NCCL's "bus bandwidth", nccl-tests
doc/PERFORMANCE.md). They are peak values; the cost model applies its own efficiencies.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path

from usc.dsl import OPTIONS

from .errors import CompileError


class HardwareProfileError(CompileError):
    """A hardware profile name is unknown or a profile file is malformed; the message says which field."""


@dataclass(frozen=True)
class HardwareProfile:
    """Peak numbers of one GPU and its links. Units: FLOP/s, bytes, bytes/s, seconds."""

    name: str
    peak_bf16_flops: float  # dense tensor-core bf16 matmul throughput
    peak_fp32_flops: float  # plain fp32 (no TF32): what an fp32 plan's matmuls run at
    hbm_bytes: int  # device memory capacity
    hbm_bandwidth: float
    intra_node_bandwidth: float  # per GPU, one direction (NVLink/NVSwitch)
    intra_node_latency: float  # per collective step inside a node
    inter_node_bandwidth: float  # per GPU, one direction (the GPU's NIC share)
    inter_node_latency: float  # per collective step across nodes
    gpus_per_node: int
    # How close a step gets to the peaks above (see docs/cost_model.md, "Calibration"); the defaults
    # are the datacenter-GPU values, a measured profile (benchmarks/calibrate.py) writes its own.
    matmul_efficiency: float = 0.6  # sustained fraction of the matmul peak on large per-rank matmuls
    matmul_half_rows: float = 256.0  # rows per microbatch at which matmuls reach half of that
    matmul_half_work: float = 0.0  # multiply-adds of one matrix-product call at which it reaches half
    #                                the sustained rate: a call of W runs at matmul_efficiency *
    #                                W / (W + matmul_half_work), i.e. costs a fixed device time beside
    #                                its FLOPs; set, it replaces the fall-off by rows (narrow products
    #                                -- k/v, tp's slices -- fall off as short ones do); 0: by rows
    attention_efficiency: float = 0.0  # fraction of the peak attention's forward + backward reaches,
    #                                    counted as 3x its forward FLOPs like the rest of the model
    #                                    (fused flash kernels run below the matmuls); 0: the matmul rate
    comm_efficiency: float = 0.8  # fraction of the link bandwidth collectives reach on large messages
    pointwise_traffic: float = 3.0  # bytes element-wise work (norms, activations, residuals, the loss's
    #                                 softmax) moves through memory, forward + backward, per byte of
    #                                 activation a layer saves: 3 is one write and two reads of each;
    #                                 unfused intermediates that are not saved raise it
    unit_overhead: float = 0.0  # the host's seconds per pipeline unit (layer) per microbatch, forward +
    #                             backward: kernel launches and Python, whatever the size (host_launch
    #                             says whether it hides behind the device's work or adds to it)
    latency_steps: str = "tree"  # "tree": log2(n) latency steps per collective (NCCL); "ring": n-1 (gloo)
    host_launch: str = "async"  # "async": the host queues kernels ahead of the device (CUDA streams), so
    #                             unit_overhead shows only where the device finishes a microbatch's
    #                             layers sooner than the host issues them; "sync": the host runs the
    #                             kernels itself (CPU ranks), and the overhead adds to the compute
    comm_overlap: float = 1.0  # fraction of the compute a collective can hide behind: 1 where transfers run
    #                            beside compute (NCCL's own SMs and copy engines), 0 where they need the
    #                            cores compute uses (gloo with more processes than cores)
    # What each kind of collective takes over the formula (1: as the formula says, NCCL's case);
    # calibrate.py measures them for gloo, whose all-gather and reduce-scatter run slower than its ring
    all_reduce_factor: float = 1.0
    all_gather_factor: float = 1.0
    reduce_scatter_factor: float = 1.0
    all_to_all_factor: float = 1.0
    send_recv_factor: float = 1.0
    host_cores: float = 0.0  # cores one node's ranks share: 0 where each rank owns its device (GPUs);
    #                          fewer than the node's ranks (CPU processes), a rank idle in a pipeline
    #                          bubble gives its core to the busy ones (compiler/shared_cores.py)
    # Seconds a blocking collective waits, beyond its transfer, for its group's ranks to meet after
    # computing, as (ranks in the group, seconds) pairs: where ranks share cores the OS runs them in
    # turns, so partners finish the same work up to a time slice apart and a core idles while the
    # last finishes (calibrate.py measures it while every rank computes; linear between the pairs,
    # the ends held beyond them). Measured after ``sync_skew_gap`` seconds of compute between
    # meetings: a shorter gap waits proportionally less (0: the table at any gap). Empty (each rank
    # owns its device): no wait.
    sync_skew_by_ranks: tuple = ()
    sync_skew_gap: float = 0.0
    # Measured bus bandwidth (nccl-tests' busbw, bytes/s) of each kind on large messages over a group
    # that fills N whole nodes, as (N, busbw) pairs from 2 nodes up: a fabric's collectives slow down
    # as they span more nodes (congestion, rails, switch tiers), which no per-link number shows. A
    # crossing group of a kind with a table runs at the busbw of as many whole nodes as its ranks would
    # fill (log-log between the pairs; the last pair's beyond them, which the planner flags), at most
    # its NICs' peak; a kind without one takes the NIC formula above. Empty: the formula for every kind.
    all_reduce_busbw_by_nodes: tuple = ()
    all_gather_busbw_by_nodes: tuple = ()
    reduce_scatter_busbw_by_nodes: tuple = ()
    # All-reduce bus bandwidth per rank that a training step's gradient reduction sustains over a dp
    # group spanning nodes, as (ranks of the group in each node, busbw) pairs: measured inside steps
    # (bucketed messages beside the backward's kernels), not by nccl-tests on whole nodes. A group's
    # gradient reduction and ZeRO-1/2's gather run at most at the figure for its ranks per node (log-log
    # between the pairs; reduce-scatter and all-gather scaled by the by-nodes tables' ratio to
    # all-reduce). Empty: the by-nodes reading above alone.
    gradient_busbw_by_ranks_per_node: tuple = ()
    # Seconds a pipeline transfer across nodes takes beyond its bytes, by the nodes the whole mesh
    # spans, as (nodes, seconds) pairs read from measured steps (linear between the pairs, the ends
    # held beyond them): a cost that appears with the fabric's scale, not with the message -- the
    # Ultra-Scale Playbook's sweep shows none on 2-32 nodes and ~0.17 s per transfer on 64 under
    # nanotron (benchmarks/data/playbook_cluster.toml; docs/cost_model.md, "The playbook's sweep").
    # Empty (the built-in profiles): the link's latency alone.
    pipeline_transfer_seconds_by_nodes: tuple = ()

    def __post_init__(self) -> None:
        for name in BUSBW_FIELDS.values():
            object.__setattr__(self, name, _busbw_table(self.name, name, getattr(self, name)))
        object.__setattr__(self, GRADIENT_FIELD, _busbw_table(self.name, GRADIENT_FIELD,
                                                              getattr(self, GRADIENT_FIELD), least=1))
        object.__setattr__(self, PIPELINE_FIELD, _seconds_table(self.name, PIPELINE_FIELD,
                                                                getattr(self, PIPELINE_FIELD)))
        object.__setattr__(self, SKEW_FIELD, _seconds_table(self.name, SKEW_FIELD, getattr(self, SKEW_FIELD),
                                                            least=2, what="group size", unit="ranks",
                                                            example="[[2, 0.0015], [4, 0.004]]"))
        for f in fields(self):
            _check_field(self.name, f.name, getattr(self, f.name))
        if int(self.gpus_per_node) != self.gpus_per_node:
            raise HardwareProfileError(
                f"hardware profile {self.name!r}: 'gpus_per_node' must be an integer, got {self.gpus_per_node!r}"
            )

    def peak_flops(self, dtype: str) -> float:
        """Matmul peak for the plan's compute dtype ("bf16"/"fp16" on tensor cores, else fp32)."""
        return self.peak_bf16_flops if dtype in ("bf16", "bfloat16", "fp16", "float16") else self.peak_fp32_flops

    @property
    def has_fast_bf16(self) -> bool:
        """Whether bf16 matmuls outrun fp32 here: then the planner assumes dtype=bf16 unless told."""
        return self.peak_bf16_flops > self.peak_fp32_flops

    def link(self, *, crosses_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of the slowest link a group uses: NIC once it spans nodes."""
        if crosses_node:
            return self.inter_node_bandwidth, self.inter_node_latency
        return self.intra_node_bandwidth, self.intra_node_latency

    @functools.cached_property
    def collective_factors(self) -> tuple:
        """(kind, factor) of the kinds whose factor is not 1, as ``collective_seconds`` reads them."""
        kinds = ((kind, getattr(self, name)) for kind, name in FACTOR_FIELDS.items())
        return tuple((k, f) for k, f in kinds if f != 1.0)

    @functools.cached_property
    def measured_nodes(self) -> int:
        """The most nodes any busbw-by-nodes table measured (0: no table; the formula throughout)."""
        return max((pairs[-1][0] for pairs in (getattr(self, f) for f in BUSBW_FIELDS.values()) if pairs),
                   default=0)

    @functools.cached_property
    def link_cache(self) -> dict:
        """The cost model's measured links of this profile by (ranks, ranks per node): the planner asks
        for every collective of every plan, and hashing the whole profile per call cost more."""
        return {}

    def busbw_across(self, kind: str, nodes: int) -> "float | None":
        """Measured bus bandwidth of ``kind`` over a group filling ``nodes`` nodes (log-log between
        the table's node counts, its ends held beyond them); None when the profile has no table for it."""
        name = BUSBW_FIELDS.get(kind)
        return _between(getattr(self, name) if name else (), nodes)

    def gradient_busbw(self, ranks_per_node: int) -> "float | None":
        """What a gradient reduction sustains per rank over a dp group spanning nodes with
        ``ranks_per_node`` of its ranks in each (``gradient_busbw_by_ranks_per_node``, log-log
        between its pairs, its ends held beyond them); None when the profile has no such table."""
        return _between(self.gradient_busbw_by_ranks_per_node, ranks_per_node)

    def pipeline_transfer_seconds(self, nodes: float) -> float:
        """What a pipeline transfer across nodes takes beyond its bytes on a mesh spanning ``nodes``
        nodes (``pipeline_transfer_seconds_by_nodes``, linear between its pairs, its ends held beyond
        them); 0 where the profile has no such table."""
        return _between(self.pipeline_transfer_seconds_by_nodes, nodes, log=False) or 0.0

    def skew(self, ranks: int, gap: float) -> float:
        """Seconds one blocking collective over ``ranks`` waits for them to meet after ``gap`` seconds
        of compute since their last meeting (``sync_skew_by_ranks``, less below ``sync_skew_gap``);
        0 on a profile without the table, or for a group of one."""
        if not self.sync_skew_by_ranks or ranks < 2 or gap <= 0:
            return 0.0
        wait = _between(self.sync_skew_by_ranks, ranks, log=False)
        return wait * min(1.0, gap / self.sync_skew_gap) if self.sync_skew_gap else wait

    def matmul_rate(self, rows: float, dtype: str) -> float:
        """FLOP/s of one rank's matmuls with ``rows`` rows (tokens) per call: the peak times the
        sustained efficiency, falling off below ``matmul_half_rows`` -- or, with
        ``matmul_half_work``, the sustained rate, each call's fixed time added by ``matmul_seconds``."""
        if self.matmul_half_work:
            return self.peak_flops(dtype) * self.matmul_efficiency
        return self.peak_flops(dtype) * self.matmul_efficiency * rows / (rows + self.matmul_half_rows)

    def matmul_seconds(self, flops: float, calls: float, rows: float, dtype: str) -> float:
        """Seconds of ``calls`` matrix products of ``flops`` FLOPs in all, ``rows`` rows each: with
        ``matmul_half_work`` each call of W multiply-adds runs at W / (W + half) of the sustained
        rate, which is the same as 2 * half FLOPs more per call at that rate."""
        return (flops + 2 * self.matmul_half_work * calls) / self.matmul_rate(rows, dtype)

    def attention_rate(self, rows: float, dtype: str) -> float:
        """FLOP/s of attention's score and value products (forward + backward over 3x the forward's
        FLOPs): ``attention_efficiency`` of the peak, or the matmul rate where the profile has none."""
        if self.attention_efficiency:
            return self.peak_flops(dtype) * self.attention_efficiency
        return self.matmul_rate(rows, dtype)

    def to_dict(self) -> dict:
        return asdict(self)


# The profile field of each collective kind's factor (``collective_factors``; calibrate.py writes them).
FACTOR_FIELDS = {"all-reduce": "all_reduce_factor", "all-gather": "all_gather_factor",
                 "reduce-scatter": "reduce_scatter_factor", "all-to-all": "all_to_all_factor",
                 "send/recv": "send_recv_factor"}

# The profile field of each kind's measured bus bandwidth by node count (``busbw_across``).
BUSBW_FIELDS = {"all-reduce": "all_reduce_busbw_by_nodes", "all-gather": "all_gather_busbw_by_nodes",
                "reduce-scatter": "reduce_scatter_busbw_by_nodes"}


# The profile field of the gradient reduction's bus bandwidth by ranks per node (``gradient_busbw``).
GRADIENT_FIELD = "gradient_busbw_by_ranks_per_node"

# The profile field of a pipeline transfer's time by the mesh's node count (``pipeline_transfer_seconds``).
PIPELINE_FIELD = "pipeline_transfer_seconds_by_nodes"

# The profile field of a blocking collective's wait for its group to meet, by group size (``skew``).
SKEW_FIELD = "sync_skew_by_ranks"


def _between(pairs: tuple, x: float, *, log: bool = True) -> "float | None":
    """The value at ``x`` of ascending (x, value) ``pairs``, the ends held beyond them; None for no
    pairs. Between two pairs log-log (bandwidths, which fall as powers of the count) or, with
    ``log=False``, linear (times, which may be 0)."""
    if not pairs:
        return None
    if x <= pairs[0][0]:
        return pairs[0][1]
    for (n0, v0), (n1, v1) in zip(pairs, pairs[1:]):
        if x <= n1:
            if not log:
                return v0 + (x - n0) / (n1 - n0) * (v1 - v0)
            t = math.log(x / n0) / math.log(n1 / n0)
            return math.exp(math.log(v0) + t * (math.log(v1) - math.log(v0)))
    return pairs[-1][1]


def _busbw_table(profile: str, name: str, value, least: int = 2) -> tuple:
    """``value`` as ((count, busbw), ...) with counts from ``least`` up, ascending; raise naming the
    field. The count is nodes (the by-nodes tables, from 2: one node is NVLink's) or ranks per node
    (the gradient table, from 1)."""
    what, unit = ("node count", "nodes") if least == 2 else ("ranks per node", "ranks per node")
    example = "[[2, 361.7e9], [4, 160.1e9], ...]" if least == 2 else "[[1, 24e9], [2, 33.9e9], ...]"
    return _checked_pairs(
        profile, name, value, least=least, what=what, unit=unit, second="busbw",
        how=f"{example}: ({what}, bus bandwidth in bytes/s) pairs, {what}s from {least} up",
        count_note=" (one node is NVLink's)" if least == 2 else "",
        bad_value=lambda busbw, count: None if _is_number(busbw) and busbw > 0 else
        f"has bandwidth {busbw!r} at {count} {unit}: a positive number of bytes/s")


def _seconds_table(profile: str, name: str, value, *, least: int = 1, what: str = "node count",
                   unit: str = "nodes", example: str = "[[32, 0.0], [64, 0.17]]") -> tuple:
    """``value`` as ((count, seconds), ...), counts whole and ascending from ``least`` (nodes of the
    mesh, or ranks of a group), seconds at least 0; raise naming the field."""
    return _checked_pairs(
        profile, name, value, least=least, what=what, unit=unit, second="seconds",
        how=f"{example}: ({unit}, seconds) pairs, {what}s ascending from {least}",
        bad_value=lambda seconds, count: None if _is_number(seconds) and seconds >= 0 else
        f"has {seconds!r} seconds at {count} {unit}: a number of at least 0")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _checked_pairs(profile: str, name: str, value, *, least: int, what: str, unit: str, second: str,
                   how: str, bad_value, count_note: str = "") -> tuple:
    """``value`` as ((count, number), ...): whole counts from ``least`` up, each once and ascending,
    values that ``bad_value(value, count)`` finds nothing wrong with (it returns why, or None);
    raise naming the field, the pair and how to write it."""
    def bad(why: str) -> HardwareProfileError:
        return HardwareProfileError(f"hardware profile {profile!r}: {name!r} {why}; write it as {how}")
    if not isinstance(value, (list, tuple)):
        raise bad(f"must be a list of pairs, got {value!r}")
    pairs = []
    for pair in value:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise bad(f"holds {pair!r}, not a ({unit}, {second}) pair")
        count, number = pair
        if not _is_number(count) or count != int(count) or count < least:
            raise bad(f"has {what} {count!r}: a whole number of at least {least}{count_note}")
        problem = bad_value(number, count)
        if problem:
            raise bad(problem)
        pairs.append((int(count), float(number)))
    if [n for n, _ in pairs] != sorted({n for n, _ in pairs}):
        raise bad(f"must list each {what} once, ascending")
    return tuple(pairs)


# Fields that may be zero (an overhead nobody measured is no overhead), and the string-valued ones.
MAY_BE_ZERO = ("unit_overhead", "comm_overlap", "host_cores", "attention_efficiency", "matmul_half_work",
               "sync_skew_gap")
TEXT_FIELDS = {"latency_steps": ("tree", "ring"), "host_launch": ("async", "sync")}
PAIR_TABLES = frozenset((*BUSBW_FIELDS.values(), GRADIENT_FIELD, PIPELINE_FIELD, SKEW_FIELD))


def _check_field(profile: str, name: str, value) -> None:
    """Raise naming the field when ``value`` is not allowed for it."""
    if name == "name":
        if not isinstance(value, str) or not value:
            raise HardwareProfileError("hardware profile: 'name' must be a non-empty string")
    elif name in PAIR_TABLES:
        return  # checked (and normalised) by _checked_pairs
    elif name in TEXT_FIELDS:
        if value not in TEXT_FIELDS[name]:
            raise HardwareProfileError(f"hardware profile {profile!r}: {name!r} must be one of "
                                       f"{list(TEXT_FIELDS[name])}, got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            value > 0 or (name in MAY_BE_ZERO and value == 0)):
        raise HardwareProfileError(
            f"hardware profile {profile!r}: {name!r} must be a positive number, got {value!r}")


# The built-in profiles are files (compiler/profiles/<name>.toml, each number with its source), so a
# user edits a copy of the one closest to their machine rather than this module.
PROFILES_DIR = Path(__file__).parent / "profiles"


def _builtin(name: str) -> HardwareProfile:
    path = PROFILES_DIR / f"{name}.toml"
    return profile_from_dict(_read_table(path), source=str(path))


BUILTIN_PROFILES: dict[str, HardwareProfile] = {}  # filled below, once the readers are defined


def with_plan_memory(hw: HardwareProfile, plan) -> HardwareProfile:
    """``hw`` with the device memory the plan writes (``memory=40GB``: an A100-40GB, say)."""
    if not plan.is_set("memory"):
        return hw
    written = OPTIONS["memory"].kind.format(int(plan.get("memory")))
    return replace(hw, name=f"{hw.name} with memory={written}", hbm_bytes=int(plan.get("memory")))


def hardware_profile(spec: "str | Path | HardwareProfile") -> HardwareProfile:
    """A profile from a built-in name ("h100", "a100"), a .toml/.json file path, or a profile."""
    if isinstance(spec, HardwareProfile):
        return spec
    key = str(spec).strip()
    if key.lower() in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[key.lower()]
    path = Path(key)
    if path.suffix.lower() in (".toml", ".json") or path.exists():
        return load_hardware_profile(path)
    raise HardwareProfileError(
        f"unknown hardware {key!r}: use one of {sorted(BUILTIN_PROFILES)} or a .toml/.json profile file"
    )


def load_hardware_profile(path: "str | Path") -> HardwareProfile:
    """Read a profile file (TOML or JSON, keys = HardwareProfile fields, optional ``base``)."""
    path = Path(path)
    if not path.exists():
        raise HardwareProfileError(f"hardware profile file {str(path)!r} does not exist")
    data = _read_table(path)
    return profile_from_dict(data, source=str(path))


def profile_from_dict(data: dict, *, source: str = "<dict>") -> HardwareProfile:
    """Build a profile from a mapping; ``base`` names a built-in profile whose fields fill the gaps."""
    data = dict(data)
    base_name = data.pop("base", None)
    known = {f.name for f in fields(HardwareProfile)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise HardwareProfileError(
            f"{source}: unknown field(s) {unknown}; a profile has {sorted(known)} and optional 'base'"
        )
    if base_name is not None:
        if str(base_name).lower() not in BUILTIN_PROFILES:
            raise HardwareProfileError(f"{source}: base {base_name!r} is not one of {sorted(BUILTIN_PROFILES)}")
        data.setdefault("name", Path(source).stem)
        return replace(BUILTIN_PROFILES[str(base_name).lower()], **data)
    missing = sorted(f.name for f in fields(HardwareProfile) if f.name not in data and f.default is MISSING)
    if missing:
        raise HardwareProfileError(f"{source}: missing field(s) {missing} (or give base = \"h100\")")
    return HardwareProfile(**data)


def _read_table(path: Path) -> dict:
    text = path.read_text()
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            data = _load_toml(text)
    except ValueError as exc:  # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        raise HardwareProfileError(f"{path}: cannot parse hardware profile: {exc}") from None
    if not isinstance(data, dict):
        raise HardwareProfileError(f"{path}: a hardware profile is a table of fields, got {type(data).__name__}")
    return data


def _load_toml(text: str) -> dict:
    try:
        import tomllib  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10: the flat `key = value` form profiles use
        return dict(_flat_toml_line(line) for line in text.splitlines() if line.split("#")[0].strip())
    return tomllib.loads(text)


def _flat_toml_line(line: str) -> tuple[str, object]:  # pragma: no cover - Python 3.10
    key, _, value = line.split("#")[0].partition("=")
    value = value.strip()
    if value.startswith("["):
        return key.strip(), json.loads(value.replace("_", ""))
    if value.startswith('"'):
        return key.strip(), value.strip('"')
    number = float(value.replace("_", ""))
    return key.strip(), int(number) if number.is_integer() and "." not in value and "e" not in value else number


H100 = _builtin("h100")
A100 = _builtin("a100")
BUILTIN_PROFILES.update({p.name: p for p in (H100, A100)})
