"""A merge's inputs: found, opened and checked, then aligned to the output's tensor names and vocabulary.

- :mod:`.open`: inputs found (local paths or hub ids), opened, and refused where they overlap each other or the
  output; the inputs named portably in the recipe written beside the output (the module was
  ``pipeline/inputs.py``);
- :mod:`.configs`: each expert's config.json against the base's: another architecture refused, a field that
  changes what the weights compute said on the console;
- :mod:`.related`: whether each expert looks fine-tuned from the base (a few weights' distance from the base's);
- :mod:`.align`: the alignment stage: every input in the output's tensor names, and the experts' own modules;
- :mod:`.vocabulary`: the vocabulary stage: experts with added tokens, their embedding rows matched by token.
"""
