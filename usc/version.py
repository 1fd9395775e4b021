"""The package version (one place: the package, its metadata and the rank fingerprint read it)."""

__version__ = "0.1.0"
