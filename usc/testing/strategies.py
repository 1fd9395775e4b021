"""Hypothesis strategies for plans over every landed dimension (needs `hypothesis` installed).

>>> from hypothesis import given
>>> from usc.testing.strategies import plans
>>> @given(plans(max_ranks=16))
... def test_my_model(plan): ...
"""

from __future__ import annotations

from hypothesis import strategies as st

SIZES = (1, 2, 4)


@st.composite
def plans(draw, *, max_ranks: int = 16, pipeline: bool = True, experts: bool = False, fuse: bool = False,
          dtype: bool = False) -> str:
    """Plan text combining dp, tp (+sp), cp (+mode), pp (+schedule, mb), zero and recompute, with at
    most ``max_ranks`` ranks; with ``experts`` also ep (carved from dp, so it adds no ranks) for
    mixture-of-experts models; with ``fuse`` also fuse=on (off by default: on CPU fused kernels run
    interpreted, slowly); with ``dtype`` also dtype=bf16 and reduce_dtype=bf16 (off by default: a
    bf16 run equals one device only within bf16 rounding). The text parses; whether it fits a model
    is the compiler's say."""
    axes = {}
    for axis in ("dp", "cp", "tp") + (("pp",) if pipeline else ()):
        size = draw(st.sampled_from(SIZES))
        if size > 1 and _ranks(axes) * size <= max_ranks:
            axes[axis] = size
    items = [f"{a}={n}" for a, n in axes.items()]
    ep = draw(st.sampled_from([1] + [n for n in (2, 4) if axes.get("dp", 1) % n == 0])) if experts else 1
    if ep > 1:
        items.insert(1, f"ep={ep}")
    if axes.get("tp", 1) > 1 and draw(st.booleans()):
        items.append("sp=on")
    if axes.get("cp", 1) > 1:
        items.append(f"cp_mode={draw(st.sampled_from(['ring', 'zigzag', 'ulysses']))}")
    if axes.get("pp", 1) > 1:
        items.append(f"schedule={draw(st.sampled_from(['gpipe', '1f1b', 'zb', 'interleaved v=2']))}")
        items.append(f"mb={axes['pp'] * draw(st.sampled_from([1, 2]))}")
    if axes.get("dp", 1) > 1 and ep == 1:  # ZeRO with ep is not implemented
        zero = draw(st.sampled_from([0, 1, 2] + ([] if axes.get("pp", 1) > 1 else [3])))
        if zero:
            items.append(f"zero={zero}")
    recompute = draw(st.sampled_from(["none", "none", "selective", "full"]))
    if recompute != "none" and "schedule=zb" not in items:  # not implemented together
        items.append(f"recompute={recompute}")
    if fuse and draw(st.booleans()):
        items.append("fuse=on")
    if dtype:
        items.extend(draw(st.sampled_from([[], ["dtype=bf16"], ["dtype=bf16", "reduce_dtype=bf16"]])))
    return " ".join(items) or "dp=1"


def _ranks(axes: dict) -> int:
    total = 1
    for n in axes.values():
        total *= n
    return total
