"""The fusion pass on compiled programs: which regions it forms, that collectives stay between
them, the report's kernel and traffic counts, and usc-lint --kernels."""

from pathlib import Path

import usc
import usc.cli
from usc.runtime.fused import FusedRegion
from usc.testing.models import LlamaConfig, TinyGPT2, TinyLlama, seeded, token_batch

ROOT = Path(__file__).resolve().parents[2]
FACTORY = f"{ROOT / 'examples' / 'tiny_llama.py'}:factory"


def llama(cfg: LlamaConfig = LlamaConfig()) -> TinyLlama:
    """TinyLlama(cfg) from seed 0: one trace for the plans a test lints or compiles it under."""
    return seeded(TinyLlama, cfg)


def region_ops(compiled) -> list[tuple[str, ...]]:
    return [tuple(str(n.target).split(".")[1] for n in m.eager.graph.nodes if n.op == "call_function")
            for m in compiled.program.gm.modules() if isinstance(m, FusedRegion)]


def test_vocab_parallel_cross_entropy_fuses_around_its_all_reduces():
    compiled = usc.compile(llama(LlamaConfig(layers=1)), "tp=2 fuse=on", example_inputs=token_batch(128, 4, 16))
    ops = region_ops(compiled)
    assert ("sub", "exp", "sum") in ops and ("log", "sub", "mul") in ops
    graph = compiled.program.gm.graph
    fused = [n for n in graph.nodes if n.op == "call_module" and n.target.startswith("usc_fused_")]
    plain = usc.lint(llama(LlamaConfig(layers=1)), "tp=2", example_inputs=token_batch(128, 4, 16))
    assert [c.kind for c in compiled.report.collectives] == [c.kind for c in plain.collectives]  # all kept
    for node in fused:  # no fused region hides a collective: its eager ops are all ATen calls
        module = compiled.program.gm.get_submodule(node.target)
        assert all(n.op in ("placeholder", "call_function", "output") for n in module.eager.graph.nodes)


def test_report_counts_kernels_and_bytes_for_the_llama_block():
    report = usc.lint(llama(), "fuse=on", example_inputs=token_batch(128, 4, 16))
    f = report.fusion
    assert f["regions"] == 12  # per layer: 2 norms (+ residual add), RoPE q and k, SwiGLU; final norm, loss
    assert f["kernels_eager"] >= 3 * f["kernels_fused"]
    assert f["bytes_eager"] >= 2 * f["bytes_fused"]
    assert "fused regions: 12" in str(report)
    assert usc.lint(llama(), "dp=1", example_inputs=token_batch(128, 4, 16)).fusion == {}


def test_gpt2_fuses_each_residual_add_with_its_layernorm():
    compiled = usc.compile(TinyGPT2(), "fuse=on", example_inputs=token_batch(128, 4, 16))
    assert region_ops(compiled) == [("add", "layer_norm")] * 5 + [("cross_entropy_loss",)]


def test_lint_kernels_prints_the_generated_source(capsys):
    assert usc.cli.main([FACTORY, "--plan", "fuse=on", "--kernels"]) == 0
    out = capsys.readouterr().out
    model, batch = _factory()
    assert out.count("@triton.jit") == 2 * len(usc.lint(model, "fuse=on", example_inputs=batch).kernels)
    assert "def fused_" in out and "tl.sum(tl.where(mask" in out and "used by: layers.0.mlp" in out
    assert usc.cli.main([FACTORY, "--plan", "dp=1", "--kernels"]) == 0
    assert "fuse=on" in capsys.readouterr().out


def _factory():
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from tiny_llama import factory
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model, batch = factory()
    return model, batch


def test_fused_program_estimates_fewer_saved_activation_bytes():
    """A fused node saves only its inputs for backward, not its intermediates."""
    batch = token_batch(128, 4, 16)
    eager = usc.lint(llama(), "dp=1", example_inputs=batch).activation_bytes
    fused = usc.lint(llama(), "fuse=on", example_inputs=batch).activation_bytes
    assert fused < eager
