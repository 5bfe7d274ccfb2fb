"""mergekit's dialect: a mergekit config read as it is and run with mergekit's meaning.

:mod:`.config` reads and recognises the config, :mod:`.methods` says how each mergekit method is computed and where
its parameters go, :mod:`.models` which models are the base and the experts, :mod:`.slices` and :mod:`.ranges` what
its ``slices`` are, :mod:`.convert` makes the specmerge recipe (``specmerge convert``, ``specmerge run``,
``specmerge.merge(mergekit_config=...)``).
"""

from specmerge.pipeline.recipe.mergekit.config import is_mergekit_config
from specmerge.pipeline.recipe.mergekit.convert import Conversion, convert, load_mergekit, say_conversion

__all__ = ["Conversion", "convert", "is_mergekit_config", "load_mergekit", "say_conversion"]
