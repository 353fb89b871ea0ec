"""What process group the unit tier may start (enforced by ``tests/unit/conftest.py``)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["check_unit_world"]


def check_unit_world(kwargs: dict) -> None:
    """Refuse (``RuntimeError``) a process group the unit tier must not start: anything but world
    size 1 over an in-memory ``HashStore`` (no TCP store, no ports, no other process)."""
    store, world = kwargs.get("store"), kwargs.get("world_size", -1)
    if world != 1 or not isinstance(store, dist.HashStore):
        raise RuntimeError(f"tests/unit may start only a one-rank world over a HashStore, not world_size={world} "
                           f"store={type(store).__name__}: multi-process tests belong in tests/distributed")
