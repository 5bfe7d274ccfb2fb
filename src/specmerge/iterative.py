"""Iterative references (in progress)."""
