"""Shared pytest setup. Keep it small: per-tier fixtures live in each tier's conftest."""

import os

# Before torch starts its thread pools: 2-core CI boxes run several ranks (threads or processes)
# at once, and oversubscribed OpenMP pools make them crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
