"""Reading checkpoint files: what a reader is, one reader per format, and the formats' names and codes.

- :mod:`.protocol`: the :class:`~.protocol.TensorSource` every reader is (names its tensors, reads one at a time);
- :mod:`.safetensors_format`, :mod:`.torch_format`: one reader per format, on the shared :mod:`.sharded` logic
  (one or more files, optionally mapped by an index);
- :mod:`.sources`: ``open_source``, the reader for a path (a file, a Hugging Face model folder, an index);
- :mod:`.files`: which files may be read (the safety rules for every path taken from a folder);
- :mod:`.layout`: which 2-D weights are stored (in, out), from the base's architecture;
- :mod:`.peft`: the PEFT LoRA adapter format: adapters read as per-tensor low-rank deltas, merged ones written;
- :mod:`.names`: the file names and safetensors dtype codes, shared by readers and writers (the module was
  ``io/formats.py``; it is ``names`` here because the sub-package took the name ``formats``).
"""
