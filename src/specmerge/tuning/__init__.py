"""Choosing a merge against the user's own evaluation: a spectral cache, ``tune`` and AdaMerging (issue 17)."""
