"""Statistics of task-vector spectra and the `specmerge inspect` report."""
