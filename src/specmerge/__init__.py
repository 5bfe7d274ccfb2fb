"""specmerge: data-free multi-task model merging by closed-form spectral filtering."""

__version__ = "0.1.0"

from specmerge.api import merge, run_recipe
from specmerge.registry import LayerResult, Method, get_method, methods, register

__all__ = ["LayerResult", "Method", "__version__", "get_method", "merge", "methods", "register", "run_recipe"]
