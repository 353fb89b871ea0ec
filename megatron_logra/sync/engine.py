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
from typing import Any, Iterable, Mapping, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn

from megatron_logra.sync.apply import ProjectionCache, stage_delta
from megatron_logra.sync.codec import SketchDelta, decode
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import fingerprint
from megatron_logra.sync.layout import VOCAB_PARALLEL

logger = logging.getLogger(__name__)

__all__ = ["DeltaConsumer", "ModuleEngine", "as_delta", "full_shape_problems"]


@runtime_checkable
class DeltaConsumer(Protocol):
    """What a transport hands deltas to."""

    @property
    def weight_version(self) -> int: ...

    def apply_sketch_delta(self, delta: Union[SketchDelta, bytes]) -> int: ...


def as_delta(delta: Union[SketchDelta, bytes, bytearray, memoryview]) -> SketchDelta:
    """Decode bytes (verifying the checksum) or pass a :class:`SketchDelta` through."""
    return delta if isinstance(delta, SketchDelta) else decode(bytes(delta))


def vocab_prefix_fits(name: str, got: Sequence[int], have: Sequence[int], min_rows: int = 1) -> bool:
    """``got`` (a vocabulary-parallel tensor's shape, at least ``min_rows`` rows) fills the first rows of a
    parameter of shape ``have``."""
    return (name in VOCAB_PARALLEL and len(got) == len(have) >= 1 and tuple(got[1:]) == tuple(have[1:])
            and max(1, min_rows) <= got[0] <= have[0])


def full_shape_problems(shapes: Mapping[str, Sequence[int]], engine: Mapping[str, Sequence[int]], *,
                        vocab_prefix: bool = False, min_vocab_rows: int = 1) -> list[str]:
    """What keeps full tensors of ``shapes`` (HF name -> shape) from loading into an engine whose parameters
    have ``engine``'s shapes: unknown and missing names, and shapes that differ (``vocab_prefix``: except a
    vocabulary-parallel tensor with fewer rows, at least ``min_vocab_rows``, which fills the engine's first
    rows). Empty: it fits."""
    out = [f"{n}: not an engine parameter" for n in sorted(set(shapes) - set(engine))]
    out += [f"{n}: missing" for n in sorted(set(engine) - set(shapes))]
    for n in sorted(set(shapes) & set(engine)):
        got, have = tuple(int(x) for x in shapes[n]), tuple(int(x) for x in engine[n])
        if got != have and not (vocab_prefix and vocab_prefix_fits(n, got, have, min_vocab_rows)):
            out.append(f"{n}: {got} != {have}")
    return out


class ModuleEngine:
    """Applies sketch deltas to the parameters of ``model`` (all-or-nothing, version checked).

    ``vocab_rows``: the vocabulary the engine serves when its vocabulary-parallel tensors
    (``embed_tokens``, ``lm_head``) hold more rows (padding, e.g. a copy of the trainer's padded
    vocabulary): its :meth:`fingerprint` then covers their first ``vocab_rows`` rows, as the trainer's
    anchor markers do (they fingerprint ``model.vocab_size`` rows), and policy sync's drift check reads it as
    :attr:`fingerprint_vocab_rows`. None: every row. ``hf`` layout only.
    """

    def __init__(self, model: nn.Module, *, layout: str = "hf", tp_size: int = 1, tp_rank: int = 0,
                 version: int = 0, vocab_rows: Optional[int] = None) -> None:
        self.model = model
        self.layout = layout
        self.tp_size = tp_size
        self.tp_rank = tp_rank
        self._version = int(version)
        self._projections = ProjectionCache()  # sign(A) kept across syncs while the projection is unchanged
        if vocab_rows is not None:
            if isinstance(vocab_rows, bool) or not isinstance(vocab_rows, int) or vocab_rows < 1:
                raise ValueError(f"vocab_rows={vocab_rows!r} must be an int >= 1 (the vocabulary the engine serves)")
            if layout != "hf" or tp_size != 1:
                raise ValueError(f"vocab_rows applies to the unsharded hf layout, not {layout} TP {tp_size}")
            short = {n: tuple(t.shape) for n, t in self.weights().items()
                     if n in VOCAB_PARALLEL and (t.dim() < 1 or t.shape[0] < vocab_rows)}
            if short:
                raise ValueError(f"vocab_rows={vocab_rows} exceeds the rows of {short}")
        self.vocab_rows = vocab_rows

    @property
    def weight_version(self) -> int:
        return self._version

    @property
    def fingerprint_vocab_rows(self) -> Optional[int]:
        """The vocabulary rows of ``embed_tokens``/``lm_head`` :meth:`fingerprint` covers (None: all)."""
        return self.vocab_rows

    def weights(self) -> dict[str, torch.Tensor]:
        """Parameter name -> tensor (``.data``; tied parameters appear once)."""
        return {n: p.data for n, p in self.model.named_parameters()}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Parameter name -> shape (what :meth:`update_weights_full` fills)."""
        return {n: tuple(t.shape) for n, t in self.weights().items()}

    def apply_sketch_delta(self, delta: Union[SketchDelta, bytes]) -> int:
        """Validate and apply one delta; returns (and records) the new version. Raises ``SyncError``: a rejection
        leaves the weights and the version untouched; a commit that fails after its first write (a kernel error)
        leaves ``weight_version = -1`` (unknown: every delta is refused until a full load succeeds)."""
        d = as_delta(delta)
        staged = stage_delta(self.weights(), d, self._version, layout=self.layout, tp_size=self.tp_size,
                             tp_rank=self.tp_rank, cache=self._projections)
        try:
            self._version = staged.commit_()
        except BaseException:
            self._version = -1  # partly written: the delta must not be applied again on top of it
            raise
        logger.info("engine weights now at version %d", self._version)
        return self._version

    def reset_version(self, version: int) -> None:
        """Set the version after a full refit (anchor) loaded outside the delta chain."""
        self._version = int(version)

    def check_full_shapes(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise the ``SyncError`` :meth:`update_weights_full` would for full tensors of these names and shapes
        (``layout`` for a sharded engine, ``shape`` otherwise) without touching anything; what
        :meth:`~megatron_logra.sync.transport.DirectoryTransport.load_full` checks before it streams a file."""
        self._check_full_layout()
        problems = full_shape_problems(shapes, self.expected_shapes(), vocab_prefix=True)
        if problems:
            raise SyncError("shape", f"update_weights_full cannot take these tensors ({len(problems)} problems, "
                                     f"e.g. {problems[:6]}): nothing was loaded")

    def _check_full_layout(self) -> None:
        if self.layout != "hf" or self.tp_size != 1:
            raise SyncError("layout", f"update_weights_full takes full HF tensors: this engine is {self.layout} "
                                      f"TP {self.tp_rank} of {self.tp_size}")

    @torch.no_grad()
    def update_weights_full(self, tensors: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Copy every parameter from ``tensors`` (HF names; a mapping or a stream of ``(name, tensor)`` pairs,
        e.g. :meth:`~megatron_logra.sync.transport.DirectoryTransport.load_full`'s) and set
        ``weight_version = version`` (any int >= 0: a reload may go back to an earlier anchor).

        ``hf`` layout only (``SyncError("layout")`` otherwise: a sharded, fused engine converts full HF
        tensors itself). Values are cast to each parameter's dtype and device. A vocabulary-parallel tensor
        (``embed_tokens``, ``lm_head``) with fewer rows than the parameter fills its first rows (the model's
        vocabulary into an engine holding padding rows, as the delta path's ``vocab`` entries do); the rows past
        it stay as they were. Unknown, repeated or missing names and other shape mismatches raise
        ``SyncError("shape")``; a mapping is checked whole before anything is
        copied, a stream tensor by tensor and consumed to its end. Any failure after some tensor was copied
        leaves ``weight_version = -1`` (unknown: every delta is refused) until a full load succeeds: a refused
        tensor, a failed copy, or an exception the stream itself raises (re-raised as it is), e.g. a read
        error of the file being streamed (on NFS, ``ESTALE`` once the producer deleted it on another node).
        A failure before the first copy leaves the weights and the version as they were.
        """
        self._check_full_layout()
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise SyncError("version", f"version={version!r} must be an int >= 0")
        params = self.weights()

        def problem(name: str, t: Any, seen: set) -> str:
            if name not in params:
                return f"{name}: unknown"
            if name in seen:
                return f"{name}: repeated"
            got, have = tuple(getattr(t, "shape", ())), tuple(params[name].shape)
            if not isinstance(t, torch.Tensor) or (got != have and not vocab_prefix_fits(name, got, have)):
                return f"{name}: {got} != {have}"
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
                dst = params[name] if t.shape == params[name].shape else params[name][: t.shape[0]]
                try:
                    dst.copy_(t.to(device=dst.device, dtype=dst.dtype))
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
        versions sweep every row; :mod:`megatron_logra.sync.fingerprint`); ``embed_tokens``/``lm_head``
        as their first ``vocab_rows`` rows when the engine was given ``vocab_rows``."""
        weights = self.weights()
        if self.vocab_rows is not None:
            weights = {n: t[: self.vocab_rows] if n in VOCAB_PARALLEL else t for n, t in weights.items()}
        return fingerprint(weights, rows_per_tensor, salt=self._version)
