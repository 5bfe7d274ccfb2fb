"""Recipe, plan, executor and the public merge API.

:mod:`.recipe` (what to merge, validated) -> :mod:`.inputs` (the base and experts opened and checked) ->
:mod:`.plan` (an action per tensor) -> :mod:`.jobs` (the merge as work items; :mod:`.work` is the executor
interface) -> an executor (:mod:`.executor`: the in-process streaming one) that reads each item, computes it
(:mod:`.compute`, with the NaN/Inf checks of :mod:`.finite`) and delivers it to the job's sink (shards or adapter
factors). :mod:`.api` drives it all: ``merge`` and ``run_recipe``. :mod:`.threads` sets torch's thread count.
"""
