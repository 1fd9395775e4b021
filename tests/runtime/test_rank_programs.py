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


def test_the_planners_fake_rank_holds_the_pieces_a_rank_holds():
    """``fake_rank_zero`` (the planner's probes) makes rank 0's state at its local shapes directly and
    binds its program without generating Python: each entry is what a rank built from the full
    state holds (shape, dtype, trainable or not, ZeRO-3's flat slice included), and the program runs."""
    from usc.compiler.trace import trace
    from usc.dsl import parse_plan
    from usc.passes import parallelize
    from usc.runtime.executor import RankExecutor, fake_rank_zero
    from usc.runtime.mesh import shape_mesh

    torch.manual_seed(0)
    config = LlamaConfig(vocab=66, hidden=36, heads=6, kv_heads=2, mlp=42, layers=2, max_seq=16)
    batch = token_batch(66, 6, 10)
    for text in ("dp=3 tp=2 zero=3", "tp=2 sp=on", "dp=3 zero=1", "cp=2"):
        program = parallelize(trace(TinyLlama(config), batch), parse_plan(text))
        full = {s.name: torch.nn.Parameter(torch.zeros(s.global_shape, dtype=s.dtype))
                if s.kind == "param" and s.trainable else torch.zeros(s.global_shape, dtype=s.dtype)
                for s in program.state}
        real = RankExecutor(program, shape_mesh(program.mesh.axes, program.mesh.shape, 0, torch.device("cpu")), full)
        with fake_rank_zero(program) as (rank, inputs):
            assert rank.state.keys() == real.state.keys()
            for name, tensor in rank.state.items():
                mine = real.state[name]
                trains = isinstance(tensor, torch.nn.Parameter), isinstance(mine, torch.nn.Parameter)
                assert (tensor.shape, tensor.dtype, trains[0]) == (mine.shape, mine.dtype, trains[1]), (text, name)
            assert [p.shape for p in rank.params] == [p.shape for p in real.params]
            loss, _, _ = rank._loss(rank._split(inputs)[0])
            assert loss.shape == ()


def _f_operators(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's f operators (identity forward, the gradient's all-reduce backward), in order."""
    from usc.runtime.collectives import GradAllReduce

    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), GradAllReduce)]


def test_every_process_compiles_the_same_program():
    """Each rank of a torchrun job compiles its own program, so the compile must not depend on
    anything that differs between processes (set order over graph nodes follows their addresses).
    The f operators a mixture-of-experts block's inputs get (a value replicated on tp feeding a
    computation split on it) were inserted in such an order: compiled four times, the graphs must
    be the same, and the f operators before one consumer in the order of its arguments."""
    from usc.build import _Compiled
    from usc.testing.models import MoEConfig, TinyMixtral

    batch = token_batch(MoEConfig().vocab, 4, 8)
    texts = set()
    for _ in range(4):
        torch.manual_seed(0)
        program = _Compiled(TinyMixtral(), "dp=2 ep=2 tp=2", example_inputs=batch).program
        gm = program.gm
        texts.add(program.listing())
        fs = _f_operators(gm)
        for consumer in {u for f in fs for u in f.users}:
            mine = [a for a in consumer.all_input_nodes if a in fs]
            assert mine == sorted(mine, key=list(gm.graph.nodes).index), consumer.name
    assert len(texts) == 1


_LISTINGS = """
import hashlib, torch
from usc.build import _Compiled
from usc.testing.models import MoEConfig, TinyLlama, TinyMixtral, token_batch
for make, plan, vocab in [(TinyMixtral, "dp=2 ep=2 tp=2", MoEConfig().vocab), (TinyLlama, "pp=2 mb=2 tp=2 sp=on", 256)]:
    torch.manual_seed(0)
    listing = _Compiled(make(), plan, example_inputs=token_batch(vocab, 4, 8)).program.listing()
    print(hashlib.sha256(listing.encode()).hexdigest())
"""


def test_a_programs_listing_is_the_same_in_every_process_and_tells_programs_apart():
    """The ranks compare their programs by ``Program.listing``'s hash (runtime/agreement.py): two
    processes (other hash seeds, other addresses) write the same listing of the same compile, and a
    listing changes with what a rank would run differently -- the order of two collectives, a
    collective's axis, an argument -- but not with the index of a device."""
    import os
    import subprocess
    import sys

    from usc.build import _Compiled
    from usc.testing.models import MoEConfig, TinyMixtral

    procs = [subprocess.Popen([sys.executable, "-c", _LISTINGS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "PYTHONHASHSEED": seed, "OMP_NUM_THREADS": "1"})
             for seed in ("1", "3")]
    runs = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert [r[2] for r in runs] == [0, 0], [r[1][-2000:] for r in runs]
    assert runs[0][0] == runs[1][0] and len(runs[0][0].split()) == 2

    torch.manual_seed(0)
    program = _Compiled(TinyMixtral(), "dp=2 ep=2 tp=2", example_inputs=token_batch(MoEConfig().vocab, 4, 8)).program
    gm, before = program.gm, program.listing()
    assert " at 0x" not in before and "<" not in before, "an address or a default repr in the listing"
    fs = _f_operators(gm)
    a, b = next((x, y) for x, y in zip(fs, fs[1:]) if x.next is y)  # two f operators side by side
    a.prepend(b)
    swapped = program.listing()
    assert swapped != before
    b.prepend(a)
    assert program.listing() == before
    gm.get_submodule(a.target).axis = "dp"
    assert program.listing() != before
    gm.get_submodule(a.target).axis = "tp"
    assert program.listing() == before
    scale = next(n for n in gm.graph.nodes if n.op == "call_function" and any(type(x) is float for x in n.args))
    scale.args = tuple(x * 2 if type(x) is float else x for x in scale.args)
    assert program.listing() != before

    from usc.compiler.program import _text

    assert _text(torch.device("cuda", 3)) == _text(torch.device("cuda", 0)) != _text(torch.device("cpu"))
