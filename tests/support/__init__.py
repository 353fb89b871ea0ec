"""Helpers shared by the test tiers: spawned gloo groups and CPU stand-ins for SGLang and TransformerEngine
modules. ``tests/`` is on ``sys.path`` (the root conftest), so tests import them as ``support.<module>``."""
