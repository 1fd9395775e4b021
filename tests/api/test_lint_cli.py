"""usc-lint on the README's example factory: text, JSON, errors, plan files, the console script."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import usc
import usc.cli

ROOT = Path(__file__).resolve().parents[2]
FACTORY = f"{ROOT / 'examples' / 'tiny_llama.py'}:factory"


def run_main(capsys, *argv):
    code = usc.cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def expected_report():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from tiny_llama import factory
    finally:
        sys.path.remove(str(ROOT / "examples"))
    model, batch = factory()
    return usc.lint(model, "dp=2 tp=2", example_inputs=batch)


def test_text_report_lists_collectives_and_per_axis_totals(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=2")
    assert code == 0
    collective_lines = [line for line in out.splitlines() if re.match(r"\s+\d+\s+all-reduce\s", line)]
    # 2 layers x (2 forward + 2 backward) + embedding + lm head + 3 for the loss on tp; on dp the token
    # count of the loss, one gradient bucket and the sum of the returned loss value; on tp the loss
    # value's finite verdict.
    assert len(collective_lines) == 2 * 4 + 1 + 1 + 3 + 3 + 1
    assert "totals per axis:" in out
    assert any(line.strip().startswith("tp: 14 calls/step") for line in out.splitlines())
    assert any(line.strip().startswith("dp: 3 calls/step") for line in out.splitlines())


def test_json_report_parses_and_matches_usc_lint(capsys, expected_report):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=2", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["collectives"]) == len(expected_report.collectives) == 17  # 15 in the program + the returned loss value and its verdict on tp
    assert data["world_size"] == 4 and data["mesh"] == {"dp": 2, "tp": 2}
    assert data["totals_by_axis"]["tp"]["calls"] == 14


def test_bad_plan_exits_1_with_a_caret(capsys):
    code, out, err = run_main(capsys, FACTORY, "--plan", "dp=2 cp=3")
    assert code == 1
    assert "plan:1:6: USC105 [error] the sequence of 32 tokens does not split into 3 pieces" in out
    lines = out.splitlines()
    shown = next(i for i, line in enumerate(lines) if line.strip() == "dp=2 cp=3")
    assert lines[shown + 1] == " " * (lines[shown].index("cp=3")) + "^^^^"


def test_bad_plan_as_json_gives_position(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 cp=3", "--json")
    assert code == 1
    data = json.loads(out)
    assert (data["error"], data["line"], data["column"]) == ("PlanError", 1, 6)
    assert data["findings"][0]["code"] == "USC105" and data["counts"]["error"] == 1


def test_compiler_error_keeps_its_caret_on_stderr(capsys):
    code, out, err = run_main(capsys, FACTORY, "--plan", "dp=2 zero=4")
    assert code == 1 and out == ""
    assert "USC100 PlanError" in err and "line 1, column 11" in err


def test_plan_file(capsys, tmp_path):
    plan = tmp_path / "mesh.usc"
    plan.write_text("# the README plan\ntp=2\nlayers.*.mlp.*: replicate\n")
    code, out, _ = run_main(capsys, FACTORY, "--plan-file", str(plan), "--json")
    assert code == 0
    data = json.loads(out)
    styles = {c["module"]: c["style"] for c in data["tensor_parallel"]}
    assert styles["layers.0.mlp.down_proj"] == "replicate"
    assert styles["layers.0.self_attn.o_proj"] == "rowwise"
    assert not [c for c in data["collectives"] if c["module"].startswith("layers.0.mlp")]


@pytest.mark.parametrize("target, message", [
    (f"{ROOT / 'examples' / 'tiny_llama.py'}:no_such_factory", "has no function 'no_such_factory'"),
    (f"{ROOT / 'examples' / 'missing.py'}:factory", "no such file"),
    (f"{ROOT / 'examples' / 'tiny_llama.py'}", "expected FILE.py:FACTORY"),
])
def test_bad_target_is_a_clear_exit(target, message, capsys):
    with pytest.raises(SystemExit) as info:
        usc.cli.main([target, "--plan", "tp=2"])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_plan_is_command_line_misuse(capsys):
    with pytest.raises(SystemExit) as info:
        usc.cli.main([FACTORY])
    assert "--plan" in capsys.readouterr().err
    assert info.value.code == 2


def test_console_script_is_installed_and_runs():
    exe = shutil.which("usc-lint")
    assert exe is not None, "usc-lint is not on PATH: is the package installed (pip install -e .)?"
    result = subprocess.run([exe, FACTORY, "--plan", "tp=2"], capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "all-reduce" in result.stdout and "totals per axis:" in result.stdout


def test_schedule_picture_needs_no_model(capsys):
    code = usc.cli.main(["--schedule", "--plan", "pp=2 mb=2 schedule=gpipe"])
    out = capsys.readouterr().out
    assert code == 0
    # rank 1 runs F0 F1 then B0 B0 B1 B1 (backward costs 2); rank 0 waits 3 units for B0's gradient
    assert "rank 0 | F0 F1 .. .. .. B0 B0 B1 B1" in out
    assert "rank 1 | .. F0 F1 B0 B0 B1 B1 .. .." in out
    assert "peak in-flight microbatches per rank 2, 2" in out


def test_schedule_json_and_bad_schedule(capsys):
    assert usc.cli.main(["--schedule", "--json", "--plan", "pp=4 mb=8 schedule=1f1b"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bubble_ratio"] == pytest.approx(3 / 8) and data["peak_in_flight"] == [4, 3, 2, 1]
    assert usc.cli.main(["--schedule", "--plan", "pp=4 mb=6 v=2 schedule=interleaved"]) == 1
    assert "multiple of pp" in capsys.readouterr().err


def test_an_unimplemented_schedule_is_refused_at_its_name(capsys):
    """schedule=dualpipe parses (the name is reserved) but has no generator: a PlanError with a
    caret under it and what to write instead, from --schedule and from compile alike."""
    assert usc.cli.main(["--schedule", "--plan", "pp=2 mb=4 schedule=dualpipe"]) == 1
    err = capsys.readouterr().err
    assert "PlanError: line 1, column 11: schedule=dualpipe is not implemented" in err
    assert "use schedule=zb" in err and "NotImplementedError" not in err
    from usc.testing.models import TinyLlama, token_batch

    with pytest.raises(usc.PlanError, match="(?s)schedule=dualpipe is not implemented.*schedule=zb"):
        usc.simulate(TinyLlama(), "pp=2 mb=2 schedule=dualpipe", example_inputs=token_batch(128, 4, 16))


def test_findings_carry_codes_and_strict_fails_on_warnings(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "tp=4")  # 2 kv heads: USC204 warning
    assert code == 0
    assert "plan:1:1: USC204 [warning] tp=4 does not divide the 2 key/value heads of 'layers.*.self_attn'" in out
    assert "memory per rank (predicted, zero=0):" in out and "found 0 error(s), 1 warning(s)" in out
    assert run_main(capsys, FACTORY, "--plan", "tp=4", "--strict")[0] == 1


def test_github_annotations_point_into_the_plan_file(capsys, tmp_path):
    plan = tmp_path / "mesh.usc"
    plan.write_text("dp=2\ntp=4 gpus_per_node=2\n")
    code, out, _ = run_main(capsys, FACTORY, "--plan-file", str(plan), "--format", "github")
    assert code == 0
    lines = out.splitlines()
    assert f"::warning file={plan},line=2,col=1,title=USC201 tp-crosses-node::each tp group spans 2 nodes: " \
           "tp=4 > gpus_per_node=2 (hint: keep tp <= 2 and write it last in the plan)" in lines
    assert all(line.startswith(("::error ", "::warning ", "::notice ")) for line in lines)


def test_github_errors_exit_1(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "cp=3", "--format", "github")
    assert code == 1
    assert out.startswith("::error file=") and "title=USC105 sequence-not-divisible::" in out


def test_explain(capsys):
    assert usc.cli.main(["--explain", "usc202"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("USC202 (row-before-column) [warning]") and "column-parallel then row-parallel" in out
    assert usc.cli.main(["--explain"]) == 0
    listing = capsys.readouterr().out.splitlines()
    assert "USC106  error    out-of-memory" in listing and len(listing) >= 20
    assert usc.cli.main(["--explain", "USC999"]) == 2
    assert "no lint rule 'USC999'" in capsys.readouterr().err


def test_diff_shows_what_changes_and_why(capsys):
    # dp=2 and cp=2 both give each rank half the tokens: the tp traffic, the weights and the
    # activations per rank are the same; the gradient sum moves from dp to cp, and cp adds the ring
    code, out, _ = run_main(capsys, FACTORY, "--diff", "dp=2 tp=2", "tp=2 cp=2", "--json")
    assert code == 0
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    assert not rows["tp bytes/step"]["changed"] and rows["tp calls/step"]["left"] == "14"
    assert not rows["parameters"]["changed"] and not rows["activations"]["changed"]
    assert rows["dp calls/step"]["right"] == "0" and rows["cp calls/step"]["left"] == "0"
    assert int(rows["cp calls/step"]["right"]) > 0 and "cp 1 -> 2" in rows["cp bytes/step"]["why"]
    code, out, _ = run_main(capsys, FACTORY, "--diff", "tp=2", "tp=2 cp=2")
    lines = out.splitlines()
    assert lines[:2] == ["A: tp=2", "B: tp=2 cp=2"]
    activations = next(line for line in lines if "activations" in line)
    assert activations.startswith("* activations") and activations.endswith("x0.50")
    step = next(line[2:] for line in lines if line[2:].startswith("step time")).split()
    assert all(float(step[i]) > 0 and step[i + 1] in ("s", "ms", "us") for i in (2, 4))  # the cost model's
    assert [line[2:].split()[0] for line in lines[lines.index("time:") + 1:-1] if not line.startswith("      ")] \
        == ["step", "compute", "host", "exposed", "bubble"]


def test_diff_names_a_plan_that_does_not_compile(capsys):
    code, _, err = run_main(capsys, FACTORY, "--diff", "tp=2", "cp=3")
    assert code == 1 and 'plan B "cp=3" does not compile' in err and "USC105" in err

def test_schedule_boxes_follow_the_dry_run():
    from usc.passes.pipeline_schedule import ComputeOp, build_schedule
    from usc.passes.pipeline_schedule_png import COLOURS, timeline_boxes

    boxes = [(b.rank, b.start, b.length, b.label) for b in timeline_boxes(build_schedule("gpipe", 2, 1, 2))]
    assert boxes == [(0, 0, 1, "0"), (0, 1, 1, "1"), (0, 5, 2, "0"), (0, 7, 2, "1"),
                     (1, 1, 1, "0"), (1, 2, 1, "1"), (1, 3, 2, "0"), (1, 5, 2, "1")]
    interleaved = timeline_boxes(build_schedule("interleaved", 2, 2, 2))
    chunk1 = next(b for b in interleaved if b.label == "c1:0")
    chunk0 = next(b for b in interleaved if b.label == "c0:0")
    assert chunk1.colour != chunk0.colour and min(chunk1.colour) > min(chunk0.colour)  # a lighter tint
    zb = {b.colour for b in timeline_boxes(build_schedule("zb", 2, 1, 2))}
    assert zb == {_rgb(COLOURS[op][0]) for op in (ComputeOp.FORWARD, ComputeOp.INPUT_GRAD, ComputeOp.WEIGHT_GRAD)}


def _rgb(colour: str) -> tuple[float, float, float]:
    return tuple(int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_schedule_png_is_drawn(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "zb.png"
    assert usc.cli.main(["--schedule", "--plan", "pp=4 mb=8 schedule=zb", "--schedule-png", str(path)]) == 0
    assert "rank 3 |" in capsys.readouterr().out
    pixels = imread(path)[..., :3].reshape(-1, 3)
    for colour in ("#56B4E9", "#E69F00", "#CC79A7"):  # F, I and W boxes are all on the picture
        assert (abs(pixels - _rgb(colour)).max(axis=1) < 0.02).sum() > 100, colour


def test_schedule_png_needs_matplotlib_and_schedule(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert usc.cli.main(["--schedule", "--plan", "pp=2 mb=2", "--schedule-png", str(tmp_path / "x.png")]) == 1
    assert "needs matplotlib" in capsys.readouterr().err and not (tmp_path / "x.png").exists()
    with pytest.raises(SystemExit) as info:
        usc.cli.main(["--plan", "pp=2 mb=2", "--schedule-png", str(tmp_path / "x.png")])
    assert info.value.code == 2 and "add --schedule" in capsys.readouterr().err
