"""Projections, canonical names and sketch capture.

``projection`` and ``canonical_name`` import only torch: inference engines use them to
regenerate ``A`` without megatron-core.
"""

from megatron_logra.sketch.naming import canonical_name, strip_wrappers
from megatron_logra.sketch.random_projection import DISTRIBUTIONS, projection

__all__ = ["canonical_name", "strip_wrappers", "projection", "DISTRIBUTIONS", "install_sketches", "SketchSet", "SketchTarget"]


_LAZY = {"install_sketches": "capture", "DEFAULT_TARGETS": "capture", "SketchSet": "sketch_set",
         "SketchTarget": "targets"}


def __getattr__(name):  # capture is imported lazily so engine processes stay light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"megatron_logra.sketch.{_LAZY[name]}"), name)
    raise AttributeError(name)
