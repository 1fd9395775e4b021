"""No host sync on the hot path: a training step makes exactly one host sync per rank (the global
loss it returns), whatever the plan: token counts, pipeline loss totals, random keys stay on the
device. The one exception is MoE dispatch: the uneven all-to-all takes its split sizes on the host
(NCCL does), so each MoE layer reads its exchanged counts once per forward: one read of one
stacked tensor, never bincount, boolean indexing or per-row loops.

Counted on the CPU by usc.testing.host_syncs (what torch.cuda.set_sync_debug_mode would report on
a GPU), on every simulated rank of a second step (the first warms caches such as the attention
kernel check)."""

from collections import Counter

import pytest
import torch

import usc
from usc.runtime.random import draw_values, global_index, op_key
from usc.testing.host_syncs import record_host_syncs
from usc.testing.models import DropoutNet, MoEConfig, TinyLlama, TinyMixtral, token_batch


def _model(kind: str):
    torch.manual_seed(0)
    if kind == "moe":
        return TinyMixtral(MoEConfig()), token_batch(MoEConfig().vocab, 4, 12)
    if kind == "dropout":
        return DropoutNet(0.3), token_batch(32, 6, 5)
    return TinyLlama(), token_batch(128, 4, 12)


def syncs_per_rank(plan: str, kind: str) -> tuple[dict[str, int], list]:
    model, batch = _model(kind)
    sim = usc.simulate(model, plan, example_inputs=batch)
    sim.step(*batch)
    with record_host_syncs() as syncs:
        sim.step(*batch)
    return Counter(s.thread for s in syncs), list(syncs)


# (plan, model, syncs per rank per step)
MOE_LAYERS = MoEConfig().layers
CASES = [
    ("dp=2", "llama", 1),
    ("tp=2 sp=on", "llama", 1),
    ("dp=2 mb=3", "dropout", 1),  # token counts of 3 microbatches, 3 random keys
    ("pp=2 mb=2 schedule=1f1b", "llama", 1),
    ("cp=2 cp_mode=ring", "llama", 1),
    ("cp=2 cp_mode=ulysses", "llama", 1),
    ("dp=2 zero=3", "llama", 1),
    ("dp=2 ep=2", "moe", 1 + MOE_LAYERS),  # + one count read per MoE layer
]


@pytest.mark.parametrize("plan,kind,bound", CASES, ids=[c[0] for c in CASES])
def test_one_host_sync_per_step(plan, kind, bound):
    per_rank, syncs = syncs_per_rank(plan, kind)
    assert len(per_rank) == usc.parse_plan(plan).world_size, per_rank  # every rank was watched
    assert set(per_rank.values()) == {bound}, "\n".join(map(str, syncs))
    loss_reads = [s for s in syncs if s.where.startswith("runtime/executor.py")]
    assert len(loss_reads) == len(per_rank)  # the one that remains is the loss, on every rank
    if kind == "moe":
        assert {s.what for s in syncs if s.where.startswith("runtime/moe.py")} == {"Tensor.tolist"}


def test_the_counter_sees_what_would_sync_on_a_gpu():
    """It can fail: reads as numbers, data-sized outputs and host data sent to the device count."""
    t = torch.tensor([1.0, 2.0, 3.0])
    with record_host_syncs() as syncs:
        float(t.sum())
        t.tolist()
        torch.bincount(t.long())
        t[t > 1.5]
        torch.repeat_interleave(t, torch.tensor([1, 2, 0]))
        torch.repeat_interleave(t, torch.tensor([1, 2, 0]), output_size=3)  # size given: no sync
    whats = Counter(s.what for s in syncs)
    assert whats == {"_local_scalar_dense.default": 1, "Tensor.tolist": 1, "bincount.default": 1,
                     "boolean indexing (output size depends on the data)": 1,
                     "lift_fresh.default": 2,  # the two torch.tensor counts
                     "repeat_interleave without output_size": 1}, whats


def test_a_random_draw_keyed_on_the_device_equals_the_host_keyed_draw():
    """The draw's key is mixed on the device now: bit for bit the numbers it drew before."""
    index = global_index((5, 7), 0, 2, 3, "cpu")
    key = op_key(torch.tensor(11), torch.tensor(2**33 + 5), 4)
    assert isinstance(key, torch.Tensor) and int(key) == op_key(11, 2**33 + 5, 4)
    for dist, a, b in [("uniform", -1.0, 2.0), ("normal", 0.5, 2.0), ("keep", 0.3, 0.0)]:
        on_device = draw_values(global_index((5, 7), 0, torch.tensor(2), 3, "cpu"), key, torch.float64, dist, a, b)
        on_host = draw_values(index, op_key(11, 2**33 + 5, 4), torch.float64, dist, a, b)
        assert torch.equal(on_device, on_host)
