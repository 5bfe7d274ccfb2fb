r"""Running a merge: jobs of work items, executors, the compute step, and the public merge API.

- :mod:`.api`: ``merge`` and ``run_recipe``: recipe -> inputs -> plan -> job -> executor -> writer -> report;
- :mod:`.memory`: merges in memory: state dicts, ``nn.Module``\ s and PEFT models in, a state dict out;
- :mod:`.jobs`: the two jobs (a merged model as shards, a merged LoRA adapter as factors);
- :mod:`.work`: the executor interface: work items read, computed and delivered, and the report;
- :mod:`.executor`: the in-process streaming executor (batches of same-shape spectral layers, inputs staged on a GPU
  one unit ahead); :mod:`.devices`: several devices in one process; :mod:`.ray_executor`: work items as Ray tasks;
- :mod:`.device_plan`: a merge's device plan (:mod:`specmerge.pipeline.plan.device`) made from its job and applied;
- :mod:`.compute`: the compute step of a work item (the route per method and input kind); :mod:`.batched`: same-shape
  spectral layers computed together;
- :mod:`.finite`: NaN and Inf in the inputs, found before any result is written and named by file (it checks the
  data the compute step reads, so it is here rather than in :mod:`specmerge.pipeline.inputs`);
- :mod:`.threads`: how many threads torch computes with, so that a shared CPU does not collapse;
- :mod:`.card`: the model card (README.md) written into a merged folder.
"""
