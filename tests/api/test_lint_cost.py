"""usc-lint's cost sections: --hardware adds the time breakdown; `auto` prints the planner's choice."""

import json
from pathlib import Path

import pytest

import usc.cli

ROOT = Path(__file__).resolve().parents[2]
FACTORY = f"{ROOT / 'examples' / 'tiny_llama.py'}:factory"


def run_main(capsys, *argv):
    code = usc.cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_hardware_adds_the_time_breakdown(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=2", "--hardware", "a100")
    assert code == 0
    section = out[out.index("time breakdown per step on a100"):]
    for label in ("compute", "exposed communication", "pipeline bubble", "step", "tokens/s, MFU"):
        assert label in section
    assert "exposed communication by axis: tp" in section


def test_without_hardware_there_is_no_time_breakdown(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "dp=2 tp=2")
    assert code == 0 and "time breakdown" not in out


def test_hardware_profile_file_and_json(capsys, tmp_path):
    path = tmp_path / "slow.toml"
    path.write_text('base = "h100"\nintra_node_bandwidth = 1e9\n')
    code, out, _ = run_main(capsys, FACTORY, "--plan", "tp=2", "--hardware", str(path), "--json")
    slow = json.loads(out)["time_breakdown"]
    code, out, _ = run_main(capsys, FACTORY, "--plan", "tp=2", "--hardware", "h100", "--json")
    fast = json.loads(out)["time_breakdown"]
    assert code == 0 and slow["hardware"] == "slow"
    # the same compute; tp's collectives (on the critical path) slow down with the link
    assert slow["seconds"]["compute"] == pytest.approx(fast["seconds"]["compute"])
    assert slow["seconds"]["exposed_comm"] > 5 * fast["seconds"]["exposed_comm"]


def test_unknown_hardware_is_an_error(capsys):
    code, _, err = run_main(capsys, FACTORY, "--plan", "dp=2", "--hardware", "tpu")
    assert code == 1 and "unknown hardware 'tpu'" in err


def test_auto_prints_the_choice_and_why_the_others_lost(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "auto gpus=4")
    assert code == 0
    first = out.splitlines()[0]
    chosen = out[out.index("chosen: "):].splitlines()[0].removeprefix("chosen: ")
    assert f'plan "{chosen}"' in first  # the report is of the chosen plan
    assert "alternatives" in out and "step time:" in out and "dropped:" in out


def test_auto_plans_for_the_hardware_given(capsys):
    code, out, _ = run_main(capsys, FACTORY, "--plan", "auto gpus=2", "--hardware", "a100")
    assert code == 0 and "planner: 2 GPUs (8 per node, a100)" in out and "time breakdown per step on a100" in out
