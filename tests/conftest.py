"""Shared pytest setup: the CPU tiers run on the CPU even on a GPU host; `gpu` tests skip cleanly without CUDA.

``tests/unit`` and ``tests/distributed`` are CPU tests (gloo, models on the host). On a CUDA machine
the package would put their models on the GPU and pick NCCL, so a run that is not a run of the GPU
tier hides the GPUs (``CUDA_VISIBLE_DEVICES=""``, before anything initialises CUDA; launched ranks
inherit it). The GPU tier runs on its own: ``pytest tests/gpu`` or ``pytest -m gpu``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

GPU_TIER = Path(__file__).resolve().parent / "gpu"
_HIDDEN = "CUDA is hidden while the CPU tiers run: run the GPU tier on its own (pytest tests/gpu)"


def _selects_gpu_tier(config: pytest.Config) -> bool:
    markexpr = config.option.markexpr or ""
    if re.search(r"(?<!not )\bgpu\b", markexpr):
        return True
    paths = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    return bool(paths) and all(p == GPU_TIER or GPU_TIER in p.parents for p in paths)


def pytest_configure(config: pytest.Config) -> None:
    config._cuda_hidden = False
    if not _selects_gpu_tier(config):
        config._cuda_hidden = any(Path("/dev").glob("nvidia[0-9]*"))  # only worth saying where GPUs exist
        os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=_HIDDEN if config._cuda_hidden else "needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
