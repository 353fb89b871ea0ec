"""A torch module as a sketch-delta consumer (the engine side of policy sync).

:class:`ModuleEngine` wraps any ``nn.Module`` whose parameters use an engine layout
(``hf``: a ``transformers`` causal LM; ``sglang``: fused ``qkv_proj``/``gate_up_proj`` shards
of one TP rank) and exposes the protocol the transports use::

    engine.weight_version            # int, the version its weights are at
    engine.apply_sketch_delta(x)     # x: SketchDelta or encoded bytes -> new version

Its only state besides the weights is the version, so a consumer that restarts resumes
from ``weight_version``. A restarted directory consumer verifies the producer's anchors again: by
``fingerprint`` when it sits exactly at an anchor's version; past an unverified anchor it is refused
and reloads full weights (``update_weights_full``, which
:meth:`~megatron_logra.sync.transport.DirectoryTransport.load_full` calls with the producer's
full-weights file; see :mod:`megatron_logra.sync.transport`). Imports only torch and the sync package.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Protocol, Union, runtime_checkable

import torch
from torch import nn

from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.codec import SketchDelta, decode
from megatron_logra.sync.errors import SyncError
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

    @torch.no_grad()
    def update_weights_full(self, tensors: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Copy every parameter from ``tensors`` (HF names; a mapping or a stream of ``(name, tensor)`` pairs,
        e.g. :meth:`~megatron_logra.sync.transport.DirectoryTransport.load_full`'s) and set
        ``weight_version = version`` (any int >= 0: a reload may go back to an earlier anchor).

        ``hf`` layout only (``SyncError("layout")`` otherwise: a sharded, fused engine converts full HF
        tensors itself). Values are cast to each parameter's dtype and device. Unknown, repeated or missing
        names and shape mismatches raise ``SyncError("shape")``; a mapping is checked whole before anything is
        copied, a stream tensor by tensor and consumed to its end. Any failure after some tensor was copied
        leaves ``weight_version = -1`` (unknown: every delta is refused) until a full load succeeds: a refused
        tensor, a failed copy, or an exception the stream itself raises (re-raised as it is), e.g. a read
        error of the file being streamed (on NFS, ``ESTALE`` once the producer deleted it on another node).
        A failure before the first copy leaves the weights and the version as they were.
        """
        if self.layout != "hf" or self.tp_size != 1:
            raise SyncError("layout", f"update_weights_full takes full HF tensors: this engine is {self.layout} "
                                      f"TP {self.tp_rank} of {self.tp_size}")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SyncError("version", f"version={version!r} must be an int >= 0")
        params = self.weights()

        def problem(name: str, t: Any, seen: set) -> str:
            if name not in params:
                return f"{name}: unknown"
            if name in seen:
                return f"{name}: repeated"
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(params[name].shape):
                return f"{name}: {tuple(getattr(t, 'shape', ()))} != {tuple(params[name].shape)}"
            return ""

        if isinstance(tensors, Mapping):
            bad = [p for p in (problem(n, t, set()) for n, t in tensors.items()) if p]
            missing = sorted(set(params) - set(tensors))
            if bad or missing:
                raise SyncError("shape", f"update_weights_full: {bad[:8]} missing {missing[:8]}")
        errors: list[str] = []
        seen: set[str] = set()
        try:  # the iteration too: a stream that raises (a read error) after a copy leaves the version unknown
            for name, t in (tensors.items() if isinstance(tensors, Mapping) else tensors):
                why = problem(name, t, seen)
                if why or errors:
                    errors += [why] if why else []
                    continue  # consume the rest, copy nothing more
                try:
                    params[name].copy_(t.to(device=params[name].device, dtype=params[name].dtype))
                except Exception as exc:  # noqa: BLE001 - reported below, after the stream is consumed
                    errors.append(f"{name}: copy failed ({type(exc).__name__}: {str(exc)[:200]})")
                    continue
                seen.add(name)
        except BaseException:
            if seen:
                self._version = -1
                logger.error("engine weights partly replaced (%d tensors) when the full-weights stream failed: "
                             "weight_version = -1", len(seen))
            raise
        missing = sorted(set(params) - seen)
        if errors or missing:
            if seen:
                self._version = -1
            raise SyncError("shape", f"update_weights_full: {errors[:8]} missing {missing[:8]}"
                                     f"{' (weights partly replaced: weight_version = -1)' if seen else ''}")
        self._version = version
        logger.info("engine loaded %d full tensors, weights now at version %d", len(seen), version)

    def fingerprint(self, rows_per_tensor: int = 4) -> dict[str, str]:
        """``{name: digest}`` of the weights, rows sampled with the weight version as salt (so successive
        versions sample different rows; :mod:`megatron_logra.sync.fingerprint`)."""
        return fingerprint(self.weights(), rows_per_tensor, salt=self._version)
