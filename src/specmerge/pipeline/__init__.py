"""Recipe, plan, executor and the public merge API, in one sub-package per stage.

:mod:`.recipe` (what to merge, validated) -> :mod:`.inputs` (the base and experts opened, aligned to the output's
names and checked) -> :mod:`.plan` (an action per tensor; ``prepare_merge``: everything decided before any data
is read) -> :mod:`.run` (the merge as jobs of work items, run by an executor that reads, computes and delivers
each item; ``merge`` and ``run_recipe``). :mod:`.estimate` prices the work items (the cost model, the machine's
rates, ``--dry-run``). The sub-packages' ``__init__`` files import nothing; import the modules themselves.
"""
