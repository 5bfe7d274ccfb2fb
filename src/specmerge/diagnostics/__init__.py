"""Statistics of task-vector spectra and the ``specmerge inspect`` report (the layer above the pipeline).

- :mod:`.statistics`, :mod:`.optimizer_filter`: pure functions, tensors in and numbers out (spectrum
  statistics, rank rules' cuts, proxy-reduction shares, filter shapes; iterative WUDI's empirical filter);
- :mod:`.options` (what ``inspect`` computes, the one source of its options), :mod:`.method_specs` (the
  compared methods, ``NAME[:key=value,...]``, and the default list from the registry);
- :mod:`.run`: :func:`~specmerge.diagnostics.run.inspect_model`, streaming a model's layers through the statistics;
- :mod:`.tables` (CSV, JSON, ``report.md``) and :mod:`.plots` (PNG figures) write the report folder.
"""
