"""Numerical building blocks: filters, rank rules, low-rank algebra. Imports nothing above it."""
