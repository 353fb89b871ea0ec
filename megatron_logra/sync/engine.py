"""A torch module as a sketch-delta consumer (the engine side of policy sync).

:class:`ModuleEngine` wraps any ``nn.Module`` whose parameters use an engine layout
(``hf``: a ``transformers`` causal LM; ``sglang``: fused ``qkv_proj``/``gate_up_proj`` shards
of one TP rank) and exposes the protocol the transports use::

    engine.weight_version            # int, the version its weights are at
    engine.apply_sketch_delta(x)     # x: SketchDelta or encoded bytes -> new version

Its only state besides the weights is the version, so a consumer that restarts resumes
from ``weight_version``. A restarted directory consumer verifies the producer's anchors again: by
``fingerprint`` when it sits exactly at an anchor's version; past an unverified anchor it is refused
and must reload full weights (see :mod:`megatron_logra.sync.transport`). Imports only torch and the sync package.
"""

from __future__ import annotations

import logging
from typing import Protocol, Union, runtime_checkable

import torch
from torch import nn

from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.codec import SketchDelta, decode
from megatron_logra.sync.fingerprint import fingerprint

logger = logging.getLogger(__name__)

__all__ = ["DeltaConsumer", "ModuleEngine", "as_delta"]


@runtime_checkable
class DeltaConsumer(Protocol):
    """What a transport hands deltas to."""

    @property
    def weight_version(self) -> int: ...

    def apply_sketch_delta(self, delta: Union[SketchDelta, bytes]) -> int: ...


def as_delta(delta: Union[SketchDelta, bytes, bytearray, memoryview]) -> SketchDelta:
    """Decode bytes (verifying the checksum) or pass a :class:`SketchDelta` through."""
    return delta if isinstance(delta, SketchDelta) else decode(bytes(delta))


class ModuleEngine:
    """Applies sketch deltas to the parameters of ``model`` (all-or-nothing, version checked)."""

    def __init__(self, model: nn.Module, *, layout: str = "hf", tp_size: int = 1, tp_rank: int = 0,
                 version: int = 0) -> None:
        self.model = model
        self.layout = layout
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self._version = int(version)

    @property
    def weight_version(self) -> int:
        return self._version

    def weights(self) -> dict[str, torch.Tensor]:
        """Parameter name -> tensor (``.data``; tied parameters appear once)."""
        return {n: p.data for n, p in self.model.named_parameters()}

    def apply_sketch_delta(self, delta: Union[SketchDelta, bytes]) -> int:
        """Validate and apply one delta; returns (and records) the new version. Raises ``SyncError``."""
        d = as_delta(delta)
        self._version = apply_delta_(self.weights(), d, self._version, layout=self.layout,
                                     tp_size=self.tp_size, tp_rank=self.tp_rank)
        logger.info("engine weights now at version %d", self._version)
        return self._version

    def reset_version(self, version: int) -> None:
        """Set the version after a full refit (anchor) loaded outside the delta chain."""
        self._version = int(version)

    def fingerprint(self, rows_per_tensor: int = 4) -> dict[str, str]:
        """``{name: digest}`` of the weights, rows sampled with the weight version as salt (so successive
        versions sample different rows; :mod:`megatron_logra.sync.fingerprint`)."""
        return fingerprint(self.weights(), rows_per_tensor, salt=self._version)
