"""specmerge: data-free multi-task model merging by closed-form spectral filtering."""

from specmerge.registry import LayerResult, Method, get_method, methods, register

__version__ = "0.1.0"

__all__ = ["LayerResult", "Method", "__version__", "get_method", "methods", "register"]
