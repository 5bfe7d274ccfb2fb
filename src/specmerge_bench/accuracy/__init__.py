"""Offline real-data accuracy benchmark: eight classification tasks from Debian packages and a pinned MiniLM."""
