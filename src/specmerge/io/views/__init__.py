"""Lazy views of opened inputs: what an expert holds per tensor, and inputs seen under the output's names and rows.

- :mod:`.experts`: full checkpoints and PEFT adapters behind one interface (``open_expert``);
- :mod:`.task_vectors`: what an expert holds for a tensor (dense, low-rank or zero) and the task-vector stack;
- :mod:`.aligned`: inputs under the output's tensor names, and a base that also serves the experts' own modules;
- :mod:`.name_map`: the tensor names of one model saved under another wrapper, from names and shapes alone;
- :mod:`.vocab`: experts with added tokens: the rows of embeddings and output heads matched by token string;
- :mod:`.vocab_views`: views whose vocabulary tensors have the output vocabulary's rows;
- :mod:`.memory`: checkpoints held in memory: a state dict read as a checkpoint, a PEFT model as an expert.
"""
