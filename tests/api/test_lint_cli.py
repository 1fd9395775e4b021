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
    # count of the loss, one gradient bucket and the sum of the returned loss value.
    assert len(collective_lines) == 2 * 4 + 1 + 1 + 3 + 3
    assert "totals per axis:" in out
    assert any(line.strip().startswith("tp: 13 calls/step") for line in out.splitlines())
    assert any(line.strip().startswith("dp: 3 calls/step") for line in out.splitlines())


def test_json_report_parses_and_matches_usc_lint(capsys, expected_report):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=2", "--json")
    assert code == 0
    data = json.loads(out)
    assert len(data["collectives"]) == len(expected_report.collectives) == 16  # 15 in the program + the returned loss value
    assert data["world_size"] == 4 and data["mesh"] == {"dp": 2, "tp": 2}
    assert data["totals_by_axis"]["tp"]["calls"] == 13


def test_bad_plan_exits_1_with_a_caret(capsys):
    code, out, err = run_main(capsys, FACTORY, "--plan", "dp=2 tp=3")
    assert code == 1 and out == ""
    assert "PlanError" in err and "line 1, column 6" in err
    lines = err.splitlines()
    shown = next(i for i, line in enumerate(lines) if line.strip() == "dp=2 tp=3")
    assert lines[shown + 1] == " " * (lines[shown].index("tp=3")) + "^^^^"


def test_bad_plan_as_json_gives_position(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=3", "--json")
    assert code == 1
    data = json.loads(out)
    assert (data["error"], data["line"], data["column"]) == ("PlanError", 1, 6)


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
