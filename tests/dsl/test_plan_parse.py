"""Valid plans and what they parse to; the Plan/Rule/Action API."""

from __future__ import annotations

import pickle

import pytest
from usc.dsl import (
    ACTIONS,
    AXES,
    OPTIONS,
    Action,
    Plan,
    PlanError,
    Rule,
    check_rules_match,
    load_plan,
    parse_plan,
)


def test_empty_plan_is_one_device_with_defaults():
    for text in ["", "   ", "\n\n", "# only a comment", ";;", " ; # x\n;"]:
        plan = parse_plan(text)
        assert plan == Plan()
        assert (plan.mesh_axes, plan.mesh_shape, plan.world_size) == ((), (), 1)
        assert str(plan) == ""


def test_one_line_plan():
    plan = parse_plan("dp=2 tp=2 sp=on bucket_mb=0.5 layers.*.mlp.down_proj: rowwise")
    assert plan.axes == (("dp", 2), ("tp", 2))
    assert plan.options == (("bucket_mb", 0.5), ("sp", True))
    assert plan.rules == (Rule("layers.*.mlp.down_proj", (Action("rowwise"),)),)
    assert str(plan) == "dp=2 tp=2 bucket_mb=0.5 sp=on layers.*.mlp.down_proj: rowwise"


def test_multi_line_plan_with_semicolons_and_comments():
    text = """
    # 8-way llama
    pp=2; dp=2 tp=2          # outermost first
    schedule=interleaved v=2 ; mb=8
    layers.[0-3].*: stage(0)
    layers.*.self_attn.q_proj: colwise
    lm_head: vocab, recompute
    """
    plan = parse_plan(text)
    assert plan.mesh_axes == ("pp", "dp", "tp") and plan.mesh_shape == (2, 2, 2)
    assert plan.world_size == 8
    assert dict(plan.options) == {"schedule": "interleaved", "v": 2, "mb": 8}
    assert [str(rule) for rule in plan.rules] == [
        "layers.[0-3].*: stage(0)",
        "layers.*.self_attn.q_proj: colwise",
        "lm_head: vocab, recompute",
    ]
    assert plan.rules[2].actions == (Action("vocab"), Action("recompute"))
    assert (plan.rules[0].line, plan.rules[0].column) == (5, 5)
    assert plan.positions["dp"] == (3, 11) and plan.positions["mb"] == (4, 32)


def test_space_separated_rules_are_separate_rules():
    plan = parse_plan("a: colwise b: rowwise")
    assert plan.rules == (Rule("a", (Action("colwise"),)), Rule("b", (Action("rowwise"),)))


def test_whitespace_around_punctuation_is_allowed():
    assert parse_plan("dp = 2 lm_head :vocab ,recompute") == parse_plan("dp=2 lm_head: vocab, recompute")
    assert parse_plan("a: stage( 3 )").rules[0].actions == (Action("stage", 3),)


def test_option_values_and_defaults():
    plan = parse_plan("zero=3 split=layers.4|layers.8 timeout=60 capacity_factor=1.25 fuse=off dtype=bf16")
    assert plan.get("zero") == 3
    assert plan.get("split") == ("layers.4", "layers.8")
    assert plan.get("timeout") == 60.0 and plan.get("capacity_factor") == 1.25
    assert plan.get("fuse") is False and plan.is_set("fuse")
    defaults = {name: spec.default for name, spec in OPTIONS.items()}
    assert Plan().get("bucket_mb") == 25 and Plan().get("capacity_factor") is None
    assert all(Plan().get(name) == default for name, default in defaults.items())
    assert not Plan().is_set("zero") and not Plan().is_set("dp")


def test_option_order_does_not_change_equality_or_hash():
    a, b = parse_plan("zero=1 sp=on mb=4"), parse_plan("mb=4\nsp=on;zero=1")
    assert a == b and hash(a) == hash(b) and str(a) == str(b) == "mb=4 sp=on zero=1"
    assert parse_plan("dp=2 tp=2") != parse_plan("tp=2 dp=2")  # axis order is the mesh layout


def test_positions_are_not_part_of_equality():
    assert parse_plan("dp=2\n\n  lm_head: vocab") == parse_plan("dp=2 lm_head: vocab")


def test_size_and_mesh():
    plan = parse_plan("tp=4 dp=2")
    assert (plan.size("tp"), plan.size("dp"), plan.size("pp")) == (4, 2, 1)
    assert plan.mesh_axes == ("tp", "dp") and plan.world_size == 8
    with pytest.raises(KeyError, match="did you mean 'tp'"):
        plan.size("tq")
    with pytest.raises(KeyError, match="did you mean 'zero'"):
        plan.get("zeros")


def test_with_options_validates_and_accepts_text_or_values():
    plan = parse_plan("dp=2 zero=1")
    changed = plan.with_options(sp="on", bucket_mb=2, zero=None)
    assert str(changed) == "dp=2 bucket_mb=2 sp=on" and plan.get("zero") == 1
    assert changed.with_options(sp=True) == changed
    with pytest.raises(PlanError, match="zero must be 0..3"):
        plan.with_options(zero=7)
    with pytest.raises(PlanError, match="did you mean 'zero'"):
        plan.with_options(zer=1)


def test_repr_reads_back_as_source():
    plan = parse_plan("dp=2 tp=2 split=a.b|c lm_head: vocab, stage(1)")
    assert repr(plan) == "Plan('dp=2 tp=2 split=a.b|c lm_head: vocab, stage(1)')"
    assert eval(repr(plan), {"Plan": Plan}) == plan
    rule = plan.rules[0]
    assert eval(repr(rule), {"Rule": Rule, "Action": Action}) == rule
    assert str(Action("stage", 2)) == "stage(2)" and str(Action("rowwise")) == "rowwise"


def test_rule_matching_star_crosses_dots():
    rule = Rule("layers.*.mlp.down_proj", (Action("rowwise"),))
    assert rule.matches("layers.0.mlp.down_proj") and rule.matches("layers.1.sub.mlp.down_proj")
    assert not rule.matches("layers.0.mlp.up_proj")
    ranged = Rule("layers.[0-3].mlp.*", (Action("stage", 0),))
    assert ranged.matches("layers.3.mlp.up") and not ranged.matches("layers.4.mlp.up")
    assert Rule("lm_head", (Action("vocab"),)).matches("lm_head")


def test_load_plan_reads_a_usc_file(tmp_path):
    path = tmp_path / "llama.usc"
    path.write_text("\ufeff# plan\ndp=2 tp=4\nlm_head: vocab\n", encoding="utf-8")
    plan = load_plan(path)
    assert plan == parse_plan("dp=2 tp=4 lm_head: vocab") and plan.filename == str(path)
    assert str(path) in str(plan.error_at("tp", "tp=4 does not divide 6 heads"))


def test_load_plan_errors_name_the_file(tmp_path):
    path = tmp_path / "bad.usc"
    path.write_text("dp=2\ntp=x\n")
    with pytest.raises(PlanError) as info:
        load_plan(path)
    assert (info.value.line, info.value.column) == (2, 4)
    assert str(info.value).startswith(f"{path}: line 2, column 4")
    (tmp_path / "latin.usc").write_bytes(b"dp=2\n# caf\xe9\n")
    with pytest.raises(PlanError, match="not UTF-8") as info:
        load_plan(tmp_path / "latin.usc")
    assert (info.value.line, info.value.column) == (2, 6)


def test_error_at_points_at_what_was_written():
    plan = parse_plan("dp=2\ntp=3 zero=1\nlayers.*.mlp.w2: rowwise")
    err = plan.error_at("tp", "tp=3 does not divide 32 heads", hint="use tp=2 or tp=4")
    assert (err.line, err.column, err.width) == (2, 1, 4)
    assert "    tp=3 zero=1\n    ^^^^\n" in str(err) and "hint: use tp=2 or tp=4" in str(err)
    rule_err = plan.error_at(plan.rules[0], "no such module")
    assert (rule_err.line, rule_err.column, rule_err.width) == (3, 1, len("layers.*.mlp.w2"))
    unwritten = plan.error_at("pp", "needs pp")
    assert (unwritten.line, unwritten.column) == (1, 1) and "^" not in str(unwritten)


def test_check_rules_match_suggests_the_closest_module():
    plan = parse_plan("dp=2\nlayers.*.mlp.w2: rowwise")
    modules = ["embed", "layers.0.mlp.down_proj", "layers.0.mlp.up_proj", "lm_head"]
    with pytest.raises(PlanError) as info:
        check_rules_match(plan, iter(modules))
    assert (info.value.line, info.value.column) == (2, 1)
    assert "^^^^^^^^^^^^^^^" in str(info.value) and "'layers.0.mlp.down_proj'" in str(info.value)
    check_rules_match(parse_plan("layers.*.mlp.down_proj: rowwise"), modules)


def test_dataclasses_validate_on_construction():
    for build in [
        lambda: Action("colwsie"),
        lambda: Action("stage"),
        lambda: Action("vocab", 1),
        lambda: Rule("a..b", (Action("vocab"),)),
        lambda: Rule("a", ()),
        lambda: Plan(axes=(("dq", 2),)),
        lambda: Plan(axes=(("dp", 0),)),
        lambda: Plan(axes=(("dp", 2), ("dp", 2))),
        lambda: Plan(options=(("zero", 5),)),
    ]:
        with pytest.raises(PlanError) as info:
            build()
        assert (info.value.line, info.value.column) == (1, 1)
    assert Plan(options={"sp": "on", "bucket_mb": "0.5"}) == parse_plan("sp=on bucket_mb=0.5")


def test_plan_error_pickles():
    err = parse_plan("dp=2 tp=3").error_at("tp", "bad tp", hint="h")
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.line, copy.column, copy.hint, str(copy)) == (err.line, err.column, err.hint, str(err))


def test_non_str_input_is_a_type_error():
    with pytest.raises(TypeError):
        parse_plan(b"dp=2")  # type: ignore[arg-type]


def test_exported_tables():
    assert AXES == ("dp", "tp", "pp", "cp", "ep")
    assert set(ACTIONS) == {"colwise", "rowwise", "vocab", "replicate", "expert", "recompute", "stage"}
    assert all(spec.doc and spec.name == name for name, spec in OPTIONS.items())


def test_ep_is_carved_from_dp_just_inside_it():
    """dp=4 ep=2 is 4 ranks: a dp=2 x ep=2 mesh (neighbouring data-parallel ranks share experts)."""
    plan = parse_plan("tp=2 ep=2 dp=4")
    assert (plan.mesh_axes, plan.mesh_shape, plan.world_size) == (("tp", "dp", "ep"), (2, 2, 2), 8)
    assert plan.size("dp") == 4 and str(plan) == "tp=2 ep=2 dp=4"
    assert parse_plan("dp=2 ep=2").mesh_shape == (1, 2)
    assert parse_plan("dp=2 ep=4").mesh_axes == ("dp", "ep")  # not carvable: compile refuses it by name
