"""Benchmarks of specmerge (speed, accuracy): outside the library, which never imports them."""
