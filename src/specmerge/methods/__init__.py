"""Merge methods: the registry and one module per family."""
