"""Reading checkpoints and adapters, and writing outputs (the I/O layer: it imports no merge method).

Five sub-packages, by stage (their ``__init__`` files import nothing; import the modules themselves):

- :mod:`.formats`: reading checkpoint files: the reader every format is, one reader per format, which files may
  be read, which weights are stored (in, out), MoE expert stacks, PEFT LoRA adapters (read and written, every
  config field checked), GGUF files as experts, and the formats' names;
- :mod:`.hub`: inputs given as Hugging Face hub ids, resolved to cache snapshots holding only the files a merge
  reads;
- :mod:`.views`: lazy views of opened inputs: experts behind one interface, their task vectors, inputs under the
  output's tensor names or vocabulary rows, and checkpoints held in memory;
- :mod:`.quant`: quantized checkpoints (FP8, compressed-tensors, GPTQ, AWQ, MXFP4, bitsandbytes) read as the dense
  weights they stand for, dequantized per tensor on read; every other quantization refused by name; FP8 outputs;
- :mod:`.output`: writing: safetensors shards, all-or-nothing output folders, the config, tokenizer and license
  files of a merged model.
"""
