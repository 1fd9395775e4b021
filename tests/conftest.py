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

from hypothesis import HealthCheck, settings  # noqa: E402

# Bounded examples by default so CI stays fast; `pytest --hypothesis-profile=deep` explores more.
# Tests that set their own max_examples keep them.
settings.register_profile("ci", max_examples=6, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=200, deadline=None)
settings.load_profile("ci")
