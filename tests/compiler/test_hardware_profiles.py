"""Hardware profiles: built-ins, files (TOML/JSON, with and without a base) and their errors."""

import json

import pytest

from usc.compiler.hardware import (
    A100,
    H100,
    HardwareProfile,
    HardwareProfileError,
    hardware_profile,
    load_hardware_profile,
)


def test_builtin_profiles_by_name():
    assert hardware_profile("h100") is H100
    assert hardware_profile("A100") is A100
    assert H100.peak_flops("bf16") == 989.4e12 and H100.peak_flops("fp32") == 66.9e12
    assert H100.link(crosses_node=False) == (450e9, 5e-6)
    assert A100.link(crosses_node=True) == (25e9, 10e-6)


def test_unknown_name_lists_the_choices():
    with pytest.raises(HardwareProfileError, match=r"unknown hardware 'b200'.*\['a100', 'h100'\]"):
        hardware_profile("b200")


def test_toml_file_with_base_overrides_fields(tmp_path):
    path = tmp_path / "roce.toml"
    path.write_text('base = "h100"\ninter_node_bandwidth = 25e9\ninter_node_latency = 15e-6\n')
    profile = hardware_profile(str(path))
    assert profile.name == "roce"
    assert profile.inter_node_bandwidth == 25e9 and profile.inter_node_latency == 15e-6
    assert profile.peak_bf16_flops == H100.peak_bf16_flops


def test_json_file_with_every_field_round_trips(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps(dict(A100.to_dict(), name="mine", gpus_per_node=4)))
    profile = load_hardware_profile(path)
    assert profile == HardwareProfile(**dict(A100.to_dict(), name="mine", gpus_per_node=4))


@pytest.mark.parametrize(
    "text, message",
    [
        ('base = "h100"\nnic_bandwidth = 1e9\n', r"unknown field\(s\) \['nic_bandwidth'\]"),
        ('name = "x"\npeak_bf16_flops = 1e15\n', r"missing field\(s\) \['gpus_per_node'"),
        ('base = "h100"\ngpus_per_node = 0\n', r"'gpus_per_node' must be a positive number"),
        ('base = "h100"\nhbm_bytes = "80GB"\n', r"'hbm_bytes' must be a positive number, got '80GB'"),
        ('base = "tpu"\n', r"base 'tpu' is not one of"),
        ("peak = = 1\n", r"cannot parse hardware profile"),
    ],
)
def test_malformed_profile_files_name_the_field(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(HardwareProfileError, match=message):
        hardware_profile(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(HardwareProfileError, match="does not exist"):
        hardware_profile(str(tmp_path / "nope.toml"))
