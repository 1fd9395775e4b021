"""The gloo harness lives beside these tests and is imported as `harness`."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
