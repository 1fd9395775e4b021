"""Make the gloo harness in tests/distributed importable as `harness` from this folder."""

import sys
from pathlib import Path

_HARNESS_DIR = str(Path(__file__).resolve().parents[1] / "distributed")
if _HARNESS_DIR not in sys.path:
    sys.path.insert(0, _HARNESS_DIR)
