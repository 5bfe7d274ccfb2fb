"""The installed version of specmerge (no imports: every layer may read it)."""

__version__ = "0.1.0"
