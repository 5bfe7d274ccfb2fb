"""Writing a merge's output: the weights, the folder they appear in, and the files that go with them.

- :mod:`.writer`: the shard writer: safetensors files streamed one tensor (or row block) at a time;
- :mod:`.folder`: the output folder: where a merge may write, and how it appears only when complete (the module
  was ``io/output.py``; it is ``folder`` here because the sub-package took the name ``output``);
- :mod:`.work_folders`: the hidden work folders an output is written in, and how abandoned ones are removed;
- :mod:`.model_files`: a merged model's files besides its weights: config, tokenizer and code;
- :mod:`.tokenizers`: tokenizers of model folders, read with ``transformers`` from checked copies, and written;
- :mod:`.readme`: the license an input's README.md states, for the merged model's card.
"""
