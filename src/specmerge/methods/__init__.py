"""Merge methods: the catalog of built-in methods, one module per family, and the registry.

The family modules register their methods when imported (``@register`` in :mod:`.registry`); this
catalog imports them and lists them in display order (``specmerge methods``, the demo, the accuracy
table): the families in :data:`FAMILIES` order, each in its own definition order, then user plugins
(methods registered from any other module) in registration order.
"""

from specmerge.methods import breadcrumbs, della, interpolation, linear, ram, sparse, spectral, spherical, svd, wudi
from specmerge.methods.registry import LayerResult, Method, Setting, lookup, register, register_variant, registered

# display order: baselines first, the paper's filters last
# mergekit's spherical means and RAM last
FAMILIES = (linear, interpolation, sparse, breadcrumbs, della, svd, wudi, spectral, spherical, ram)


def all_methods() -> dict[str, Method]:
    """All registered methods, by name, in display order."""
    position = {family.__name__: i for i, family in enumerate(FAMILIES)}
    ordered = sorted(registered(), key=lambda method: position.get(method.fn.__module__, len(FAMILIES)))
    return {method.name: method for method in ordered}


def get_method(name: str) -> Method:
    """The method called ``name``; an unknown name raises with a did-you-mean hint."""
    return lookup(name)


def candidate_settings() -> list[tuple[Method, Setting]]:
    """Every benchmark row of every registered method, in display order: (method, setting)."""
    return [(method, setting) for method in all_methods().values() for setting in method.settings]


__all__ = [
    "FAMILIES",
    "LayerResult",
    "Method",
    "Setting",
    "all_methods",
    "candidate_settings",
    "get_method",
    "register",
    "register_variant",
]
