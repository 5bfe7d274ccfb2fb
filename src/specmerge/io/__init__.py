"""Reading checkpoints and adapters, and writing outputs (the I/O layer: it imports no merge method).

Reading: :mod:`.protocol` (the :class:`~.protocol.TensorSource` every reader is), one reader per format
(:mod:`.safetensors_format`, :mod:`.torch_format` on the shared :mod:`.sharded` logic; :mod:`.peft` for PEFT LoRA
adapters), :mod:`.sources` (``open_source``: the reader for a path), :mod:`.files` (which files may be read),
:mod:`.layout` (which weights are stored (in, out)). Experts: :mod:`.experts` (full checkpoints and adapters
behind one interface) and :mod:`.task_vectors` (what an expert holds for a tensor: dense, low-rank or zero, and
the task-vector stack). Writing: :mod:`.writer` (safetensors shards), :mod:`.output` and :mod:`.work_folders`
(all-or-nothing output folders), :mod:`.model_files` (config, tokenizer), :mod:`.peft` (merged adapters).
Names and codes of the formats, shared by readers and writers: :mod:`.formats`.
"""
