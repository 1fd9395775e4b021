"""Shared pytest setup. Keep it small: per-tier fixtures live in each tier's conftest."""

import os

# Before torch starts its thread pools: 2-core CI boxes run several ranks (threads or processes)
# at once, and oversubscribed OpenMP pools make them crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Fused kernels (fuse=on) run on CPU under Triton's interpreter; it must be chosen before triton
# is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Run the IR verifier after every compiler pass in tests (usc.compiler.pass_runner.run_pipeline).
os.environ.setdefault("USC_DEBUG", "1")

# Reuse the trace of a model already traced with the same structure, attributes, values and inputs
# (compiler/trace_memo.py says what the key holds): most tests compile one small model under many
# plans. USC_TRACE_MEMO=0 traces every compile afresh.
if os.environ.get("USC_TRACE_MEMO", "1") != "0":
    from usc.compiler import trace_memo  # noqa: E402

    trace_memo.memoize_traces(True)

import datetime  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Bounded examples by default so CI stays fast, but new ones on every commit and every day: a fixed
# seed would test the same few plans forever. The seed is printed in the header; replay a failure
# with `pytest --hypothesis-seed=SEED` (or set USC_HYPOTHESIS_SEED). `--hypothesis-profile=deep`
# explores 200 examples per test. Tests that set their own max_examples keep them.
settings.register_profile("ci", max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def ci_seed() -> int:
    """USC_HYPOTHESIS_SEED if set, else the commit and today's UTC date (new examples per commit and day)."""
    if os.environ.get("USC_HYPOTHESIS_SEED"):
        return int(os.environ["USC_HYPOTHESIS_SEED"])
    commit = int(_commit()[:8] or "0", 16)
    return commit * 100000 + datetime.datetime.now(datetime.timezone.utc).date().toordinal() % 100000


@pytest.hookimpl(tryfirst=True)  # before hypothesis' own pytest_configure reads the option
def pytest_configure(config):
    if config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(ci_seed())


def pytest_report_header(config):
    seed = config.getoption("hypothesis_seed", None)
    return f"hypothesis seed {seed} (replay: pytest --hypothesis-seed={seed})"


# The longest tests (tens of seconds to minutes here; `pytest --durations=40`) start first, so that
# with `-n auto` neither worker is left running one of them alone at the end of the run.
LONGEST_FIRST = (
    "tests/runtime/test_fake_cuda.py::test_the_tier_passes_in_a_fresh_process",
    "tests/distributed/test_fusion_equivalence.py",
    "tests/distributed/test_equivalence_gloo.py::test_gloo_ranks_match_one_device",
    "tests/compiler/test_op_coverage.py",
    "tests/distributed/test_equivalence_all_dimensions.py",
    "tests/distributed/test_plan_space.py",
    "tests/distributed/test_silent_wrongness_fuzz.py",
    "tests/distributed/test_hf_bf16.py",
    "tests/passes/test_rule_verifier.py",
    "tests/distributed/test_functional_graph.py",
    "tests/distributed/test_expert_parallel.py",
)


def pytest_collection_modifyitems(config, items):
    def rank(item) -> int:
        return next((k for k, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)),
                    len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: the order within each group, and of all other tests, is kept
