"""The merge plan: an action per tensor, and the merge prepared up to it.

- :mod:`.rules`: the plan's rules: what happens to each tensor (merge, average, keep_base), from names, shapes and
  dtypes before any data is read (the module was ``pipeline/plan.py``);
- :mod:`.lora_output`: what cannot become a PEFT adapter (``output_format: lora``), refused before any work;
- :mod:`.device`: the device plan on a GPU: device memory per layer, batch sizes within a budget, the CPU for what
  does not fit, the time from per-operation rates (issue 50);
- :mod:`.prepare`: ``prepare_merge``: the inputs opened, aligned and checked and the plan made, nothing computed
  or written yet; what a merge and a dry run share (here rather than in :mod:`specmerge.pipeline.inputs`: what
  it produces is the plan, and it uses both stages).
"""
