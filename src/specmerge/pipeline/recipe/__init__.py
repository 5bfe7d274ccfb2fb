"""The merge recipe: what to merge, read and validated completely before any tensor is read.

- :mod:`.model`: the :class:`~.model.Recipe` (pydantic) model, ``load_recipe`` and the recipe's dtypes (the
  module was ``pipeline/recipe.py``; it is ``model`` here because the sub-package took the name ``recipe``);
- :mod:`.errors`: one line for pydantic's first validation problem, and the YAML line of a key;
- :mod:`.schema`: the recipe's JSON Schema, with the registered methods and their parameters;
- :mod:`.values`: option values typed as text (command line, ``-p key=value``), read as a YAML recipe reads them;
- :mod:`.layered`: parameter values that vary across layers (a list instead of one number);
- :mod:`.expert_entries`: experts given with their weight and name;
- :mod:`.input_choice`: the recipe's names for inputs (``config_source``, ``modules``);
- :mod:`.tokenizer_source`: which vocabulary and tokenizer a merged model gets.
"""
