"""Each rank's copy of the compiled program: the program's graph and its generated Python shared,
the collective modules its own, bound to its own mesh -- in a pipeline's stages as at the top."""

import torch
import torch.fx as fx

import usc
from usc.testing.models import LlamaConfig, TinyLlama, token_batch


def _collectives(gm: fx.GraphModule) -> dict[str, torch.nn.Module]:
    """The collective nodes (bound through ``CollectiveNode.bind``: one axis, its group kept)."""
    return {name: m for name, m in gm.named_modules() if hasattr(m, "_comm") and hasattr(m, "axis")}


def test_each_rank_runs_the_one_program_over_collectives_bound_to_its_own_mesh():
    torch.manual_seed(0)
    config = LlamaConfig(vocab=67, hidden=24, heads=2, kv_heads=2, mlp=40, layers=2, max_seq=16)
    batch = token_batch(67, 4, 7)
    sim = usc.simulate(TinyLlama(config), "dp=2 tp=2 pp=2 mb=2", example_inputs=batch)
    ranks = sim.ranks
    first = ranks[0].gm
    for rank, mesh in zip(ranks, sim.meshes):
        gm = rank.gm
        assert type(gm) is type(first) and gm.graph is first.graph  # one generated forward
        stages = [m for _, m in gm.named_children() if isinstance(m, fx.GraphModule)]
        assert len(stages) == 2
        for stage, stage0 in zip(stages, [m for _, m in first.named_children() if isinstance(m, fx.GraphModule)]):
            assert stage.graph is stage0.graph and type(stage) is type(stage0)
        mine = _collectives(gm)
        assert mine, "a tp and dp plan has collectives in its stages"
        for name, module in mine.items():
            if rank is not ranks[0]:
                assert module is not _collectives(first)[name]  # no rank's module is another's
            assert module._comm is mesh.comm(module.axis)  # bound to this rank's group on its axis
    # and the ranks run it: equal to one device is the equivalence suite's; here it runs at all
    loss = sim.step(*batch)
    assert torch.isfinite(torch.tensor(loss))
