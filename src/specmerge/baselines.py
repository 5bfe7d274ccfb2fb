"""Baselines (in progress)."""
