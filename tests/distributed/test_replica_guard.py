"""The replica guard (plan option replica_check=N): copies of a tensor that must be identical across
peers are compared every N steps; a divergence raises naming the tensor and the ranks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import usc
from harness import run_world
from usc.runtime.replica_guard import ReplicaDiverged, fingerprint
from usc.testing import assert_equivalent
from usc.testing.models import GPT2Config, LlamaConfig, TinyGPT2, TinyLlama

CFG = LlamaConfig(vocab=42, hidden=24, heads=2, kv_heads=1, mlp=36, layers=2, max_seq=16)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab, (12, 9), generator=gen)
    return tokens, tokens


def _llama():
    torch.manual_seed(0)
    return TinyLlama(CFG)


def _nudge(sim, rank: int, name: str, amount: float = 1e-3) -> None:
    """Change one element of one rank's copy: the divergence a per-rank bug makes."""
    spec = next(s for s in sim.program.state if s.name == name)
    with torch.no_grad():
        sim.ranks[rank].state[spec.placeholder].view(-1)[3] += amount


def test_fingerprint_sees_one_element_and_a_swap():
    x = torch.randn(5, 7)
    y = x.clone()
    y[1, 2] += 1e-6
    z = x.clone()
    z.view(-1)[[0, 1]] = x.view(-1)[[1, 0]]
    assert torch.equal(fingerprint(x), fingerprint(x.clone()))
    assert not torch.equal(fingerprint(x), fingerprint(y))
    assert not torch.equal(fingerprint(x), fingerprint(z))


def test_a_tp_replicated_norm_weight_that_diverged_is_named_with_its_ranks():
    batch = _batch()
    sim = usc.simulate(_llama(), "dp=2 tp=2 replica_check=1", example_inputs=batch)
    sim.step(*batch)  # replicas agree: no error
    _nudge(sim, 3, "layers.1.post_attention_layernorm.weight" if _has(sim, "layers.1.post_attention_layernorm.weight")
           else "norm.weight")
    with pytest.raises(ReplicaDiverged) as info:
        sim.step(*batch)
    message = str(info.value)
    assert "norm.weight" in message and "mesh axis" in message and "rank 3" in message
    assert "after step 2" in message


def _has(sim, name: str) -> bool:
    return any(s.name == name for s in sim.program.state)


def test_a_dp_replica_that_diverged_is_named_on_the_dp_axis_at_the_next_checked_step():
    batch = _batch()
    sim = usc.simulate(_llama(), "dp=3 replica_check=2", example_inputs=batch)
    sim.step(*batch)
    sim.step(*batch)  # checked: agree
    _nudge(sim, 2, "lm_head.weight")
    sim.step(*batch)  # step 3 is not checked
    with pytest.raises(ReplicaDiverged, match=r"after step 4: 'lm_head.weight' differs between its copies on "
                                              r"mesh axis 'dp': rank 0 .* rank 2"):
        sim.step(*batch)


def test_every_rank_stops_when_another_pipeline_stage_diverged():
    batch = _batch()
    sim = usc.simulate(_llama(), "dp=2 pp=2 mb=2 replica_check=1", example_inputs=batch)
    sim.step(*batch)
    first_stage = next(s.name for s in sim.program.state if s.name.startswith("embed"))
    holder = next(r for r in sim.ranks if _holds(sim, r, first_stage) and r.mesh.coord_of("dp") == 1)
    _nudge(sim, holder.mesh.rank, first_stage)
    with pytest.raises(ReplicaDiverged, match="embed_tokens.weight"):
        sim.step(*batch)


def _holds(sim, rank, name: str) -> bool:
    spec = next(s for s in sim.program.state if s.name == name)
    return spec.placeholder in rank.state


def test_equal_runs_pass_the_guard_on_many_plans():
    """No false alarm: replicas updated by the same ops agree bitwise (assert_equivalent turns the
    guard on for every step)."""
    batches = [_batch(0), _batch(1)]
    for plan in ("dp=2 tp=2", "dp=2 zero=1 tp=2 pp=2 mb=2", "dp=2 zero=2", "dp=2 zero=3 tp=2"):
        assert_equivalent(_llama, plan, batches)
    gpt = GPT2Config(vocab=42, hidden=24, heads=2, layers=2, max_seq=16)
    assert_equivalent(lambda: TinyGPT2(gpt), "dp=2 tp=2 sp=on", batches)


def test_the_guard_is_off_unless_asked():
    batch = _batch()
    sim = usc.simulate(_llama(), "dp=2", example_inputs=batch)
    sim.step(*batch)
    _nudge(sim, 1, "lm_head.weight")
    sim.step(*batch)  # nothing compares the replicas
    assert all(rank.guard is None for rank in sim.ranks)


class Diverging(nn.Module):
    """A model whose forward differs per process: a stand-in for a per-rank bug under gloo."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(6, 10), nn.Linear(10, 6)

    def forward(self, x, y):
        return ((self.down(torch.tanh(self.up(x))) - y) ** 2).mean()


def diverge_on_gloo(rank: int, world_size: int) -> str:
    torch.manual_seed(0)
    model = Diverging()
    gen = torch.Generator().manual_seed(1)
    batch = (torch.randn(6, 6, generator=gen), torch.randn(6, 6, generator=gen))
    step = usc.compile(model, "dp=2 replica_check=1 timeout=60", example_inputs=batch)
    step.step(*batch)
    if rank == 1:
        with torch.no_grad():
            step._rank().state[next(s.placeholder for s in step.program.state if s.name == "down.bias")][0] += 0.1
    try:
        step.step(*batch)
    except ReplicaDiverged as err:
        return str(err)
    return "no error"


def test_the_guard_raises_on_every_gloo_rank():
    messages = run_world(diverge_on_gloo, 2, timeout=120)
    assert all("'down.bias' differs between its copies on mesh axis 'dp'" in m for m in messages), messages
    assert all("rank 0" in m and "rank 1" in m for m in messages)
