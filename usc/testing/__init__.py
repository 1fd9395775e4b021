"""Helpers for users' own tests: equivalence with one device, and small reference models."""

from .equivalence import EquivalenceResult, assert_equivalent

__all__ = ["assert_equivalent", "EquivalenceResult"]
