"""The package version (a bottom module: the ops key persisted decisions by it)."""
__version__ = "0.1.0"
