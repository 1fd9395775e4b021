"""Whole-mesh order check: consistent programs pass; one rank's program with a collective dropped,
or one pipeline rank's schedule missing a backward, is named by ranks and first differing call."""

import dataclasses

import pytest
import torch

from usc.build import _Compiled
from usc.compiler import lint_checks  # noqa: F401 - registers the rules
from usc.compiler.lint_rules import LintInput, run_rules
from usc.compiler.pass_runner import pipeline_stages
from usc.dsl import parse_plan
from usc.passes import copy_graph_module
from usc.passes.mesh_order_check import RankProgram, check_mesh_order, rank_programs, step_calls
from usc.passes.pipeline_schedule import build_schedule
from usc.runtime.collectives import AllReduce
from usc.testing.models import LlamaConfig, TinyLlama, token_batch

BATCH = token_batch(128, 8, 32)


def compiled(plan: str) -> _Compiled:
    torch.manual_seed(0)
    return _Compiled(TinyLlama(LlamaConfig()), plan, example_inputs=BATCH)


def schedule_of(c: _Compiled):
    p = c.plan
    return build_schedule(p.get("schedule"), p.size("pp"), int(p.get("v")), int(p.get("mb"))) \
        if p.size("pp") > 1 else None


def drop_collective(gm, module: str):
    """A copy of ``gm`` without the forward AllReduce of ``module`` (its input passed through)."""
    gm = copy_graph_module(gm)
    node = next(n for n in gm.graph.nodes if n.op == "call_module"
                and isinstance(gm.get_submodule(n.target), AllReduce) and n.meta["usc"].module == module)
    node.replace_all_uses_with(node.args[0])
    gm.graph.erase_node(node)
    gm.recompile()
    return gm


@pytest.mark.parametrize("plan", ["dp=2 tp=2", "dp=2 cp=2 tp=2 sp=on", "dp=2 pp=2 mb=2", "dp=2 zero=3",
                                  "pp=2 v=2 mb=2 schedule=interleaved", "tp=2 pp=2 mb=2 schedule=zb"])
def test_consistent_programs_pass(plan):
    c = compiled(plan)
    programs = rank_programs(c.program, schedule_of(c))
    assert len(programs) == c.plan.world_size
    assert check_mesh_order(programs, c.program, bucket_bytes=c.bucket_bytes,
                            zero_stage=int(c.plan.get("zero"))) == []


def test_a_dropped_collective_on_one_rank_is_named_with_both_ranks():
    c = compiled("dp=2 tp=2")
    programs = list(rank_programs(c.program))
    programs[3] = RankProgram(drop_collective(c.program.gm, "layers.0.self_attn.o_proj"))
    problems = check_mesh_order(programs, c.program)
    # ranks are row-major (dp outer): rank 3's tp group is (2, 3); its dp calls are untouched
    assert len(problems) == 1 and problems[0].kind == "collective" and problems[0].ranks == (2, 3)
    message = str(problems[0])
    # the embedding's all-reduce is call #1, o_proj's #2; rank 3 goes on with down_proj's
    assert "ranks 2 and 3 of tp group (2, 3) differ at their call #2 on tp" in message
    assert "rank 2 issues all-reduce [4, 32, 64] float32 at layers.0.self_attn.o_proj" in message
    assert "rank 3 issues all-reduce [4, 32, 64] float32 at layers.0.mlp.down_proj" in message
    assert "would not hang but pair different tensors" in message
    finding = run_rules(LintInput(parse_plan("dp=2 tp=2"), order_problems=tuple(problems)), select=["USC107"])
    assert [f.code for f in finding] == ["USC107"] and finding[0].severity == "error"


def test_the_walk_counts_the_calls_a_rank_makes():
    """The walked program of a tp rank: per block 2 forward and 2 backward all-reduces (README)."""
    c = compiled("tp=2")
    calls = step_calls(rank_programs(c.program)[0], c.program, microbatches=2, bucket_bytes=c.bucket_bytes,
                       zero_stage=0)
    per_microbatch = sum(1 for x in calls if x.axis == "tp" and "microbatch 0" in x.where)
    # the report of the plan with mb=1, whose one more call is the step's loss verdict (not per microbatch)
    assert per_microbatch == c.report.count(axis="tp") - 1 == 13
    assert sum(1 for x in calls if "microbatch 1" in x.where) == per_microbatch


def test_a_missing_pipeline_backward_leaves_a_send_without_its_recv():
    c = compiled("pp=2 mb=2 schedule=1f1b")
    schedule = schedule_of(c)
    programs = list(rank_programs(c.program, schedule))
    good = programs[1]
    broken = tuple(a for a in good.actions if str(a) != "1B1")  # stage 1 never runs backward of microbatch 1
    programs[1] = dataclasses.replace(good, actions=broken)
    problems = [p for p in check_mesh_order(programs, c.program) if p.kind == "p2p"]
    assert len(problems) == 1 and problems[0].ranks == (1, 0)
    message = str(problems[0])
    assert message == ("pipeline transfer from rank 1 to rank 0 is unmatched: rank 0 waits for gradient of "
                       "output 0 of stage 0, microbatch 1 [4, 32, 64] float32 from rank 1, which never sends it")
    inp = LintInput(parse_plan("pp=2 mb=2"), order_problems=tuple(problems))
    assert [f.code for f in run_rules(inp, select=["USC107", "USC108"])] == ["USC108"]


def test_pipeline_ranks_share_one_program_per_stage():
    c = compiled("dp=2 pp=2 mb=2")
    programs = rank_programs(c.program, schedule_of(c))
    stages = pipeline_stages(c.program.gm)
    # mesh dp=2 pp=2, row-major: ranks 0, 2 hold stage 0 and ranks 1, 3 stage 1
    assert [p.stage for p in programs] == [0, 1, 0, 1]
    assert programs[0] is programs[2] and programs[1].gm is stages[1]
