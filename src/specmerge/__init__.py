"""specmerge: data-free multi-task model merging by closed-form spectral filtering."""

from specmerge.methods import LayerResult, Method, all_methods, get_method, register
from specmerge.pipeline.run.api import merge, run_recipe
from specmerge.pipeline.run.memory import merge_modules, merge_state_dicts
from specmerge.tuning.adamerge import adamerge
from specmerge.tuning.tune import tune
from specmerge.version import __version__

__all__ = [
    "LayerResult",
    "Method",
    "__version__",
    "adamerge",
    "all_methods",
    "get_method",
    "merge",
    "merge_modules",
    "merge_state_dicts",
    "register",
    "run_recipe",
    "tune",
]
