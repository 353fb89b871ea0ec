"""Weight loading, sketch deltas and fingerprints of the embedded rollout engine (:class:`EmbeddedWeights`).

:class:`~megatron_logra.rollout.embedded.EmbeddedEngine` takes these methods from this mixin; they
act on the engine's ``transformers`` model in place. The contract policy sync relies on: a full
refit is checked before (a mapping) or while (a stream) copying, and a stream is always consumed to
its end, since its producer may be running collectives; a sketch delta is validated and staged whole before
its first write, and a commit that fails after that leaves ``weight_version = -1`` until a full refit; the
fingerprint covers the same rows the trainer's drift check fingerprints.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import torch

from megatron_logra.models.gpt import ModelConfig
from megatron_logra.sync.engine import full_shape_problems, vocab_prefix_fits
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import VOCAB_PARALLEL

logger = logging.getLogger(__name__)

__all__ = ["EmbeddedWeights"]


def _mismatch(name: str, value: Any, param: torch.Tensor, vocab_rows: int) -> str:
    """Why ``value`` cannot be loaded into ``param`` (not a tensor, another shape), or "" when it can:
    the same shape, or (``embed_tokens``/``lm_head``) the model's ``vocab_rows`` rows or more without the
    padding rows, as the model's HF checkpoint and a directory refit file hold them."""
    if not isinstance(value, torch.Tensor):
        return f"not a tensor ({type(value).__name__})"
    got, have = tuple(value.shape), tuple(param.shape)
    if got != have and not vocab_prefix_fits(name, got, have, vocab_rows):
        return f"shape {got} != {have}"
    return ""


class EmbeddedWeights:
    """The weight side of :class:`~megatron_logra.rollout.embedded.EmbeddedEngine` (a mixin: the engine
    sets ``cfg``, ``model``, ``device``, ``dtype``, ``vocab_size``, ``vocab_rows``, ``_version`` and
    ``_projections`` in its constructor)."""

    cfg: ModelConfig
    model: Any
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    vocab_rows: Optional[int]
    _version: int
    _projections: Any

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes :meth:`update_weights_full` requires (tied ``lm_head`` excluded)."""
        return {name: tuple(p.shape) for name, p in self.model.named_parameters()}

    @property
    def fingerprint_vocab_rows(self) -> Optional[int]:
        """The rows of ``embed_tokens``/``lm_head`` :meth:`fingerprint` covers (``vocab_rows``; None: all),
        which policy sync's drift check reads to fingerprint the trainer's same rows."""
        return self.vocab_rows

    def check_full_shapes(self, shapes: Mapping[str, Sequence[int]]) -> None:
        """Raise ``SyncError("shape")`` naming what keeps full tensors of these names and shapes from
        :meth:`update_weights_full`, without touching anything (what a directory transport's ``load_full``
        asks before it streams a file)."""
        problems = full_shape_problems(shapes, self.expected_shapes(), vocab_prefix=True,
                                       min_vocab_rows=self.cfg.vocab_size)
        if problems:
            raise SyncError("shape", f"the embedded engine cannot load these tensors ({len(problems)} problems, "
                                     f"e.g. {problems[:6]}; embed_tokens/lm_head need {self.cfg.vocab_size} to "
                                     f"{self.vocab_size} rows): nothing was loaded")

    def update_weights_full(self, hf_state: Union[Mapping[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]],
                            version: int) -> None:
        """Copy every parameter from ``hf_state`` (HF names) and set ``weight_version = version``.

        ``hf_state`` is a mapping or a stream of ``(name, tensor)`` pairs (``rl.weights.iter_hf_params``,
        which never holds the whole model). ``version`` is any int >= 0: a reload may go back to an earlier
        version (a consumer of a delta directory whose trainer resumed from an earlier checkpoint reloads that
        checkpoint's anchor), as :class:`~megatron_logra.sync.engine.ModuleEngine`'s does.
        Values are cast to the engine's dtype and device. ``embed_tokens``/``lm_head`` may hold the model's
        vocabulary without the engine's padding rows (``model.vocab_size`` rows, as the model's HF checkpoint
        and a directory refit file do): they fill the first rows, the padding rows (masked out of the
        logits) stay as they were. Unknown, repeated or missing names,
        values that are not tensors and shape mismatches raise ``ValueError`` listing them. A mapping
        is checked whole before anything is copied (such a failure leaves the engine untouched); a
        stream is checked tensor by tensor and always consumed to its end (its producer may be running
        collectives). A copy that fails (out of memory on the engine's device, a meta tensor, ...)
        stops the copying; the rest of the stream is still consumed and a ``ValueError`` names that
        tensor. Any failure after some tensor was copied leaves ``weight_version = -1`` (unknown) until a
        full refit succeeds; a failure before the first copy keeps the weights and the version.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version={version!r} must be an int >= 0")
        params = dict(self.model.named_parameters())
        if isinstance(hf_state, Mapping):
            unknown = sorted(set(hf_state) - set(params))
            missing = sorted(set(params) - set(hf_state))
            if unknown or missing:
                raise ValueError(f"update_weights_full: unknown names {unknown}, missing names {missing}")
            bad = [f"{n}: {why}" for n, t in hf_state.items() if (why := _mismatch(n, t, params[n], self.cfg.vocab_size))]
            if bad:
                raise ValueError(f"update_weights_full: wrong values {bad}")
        errors: list[str] = []
        seen: set[str] = set()
        copied = 0
        with torch.no_grad():
            for name, tensor in (hf_state.items() if isinstance(hf_state, Mapping) else hf_state):
                what = "unknown" if name not in params else "repeated" if name in seen else \
                    _mismatch(name, tensor, params[name], self.cfg.vocab_size)
                if what:
                    errors.append(f"{name}: {what}")
                    continue
                seen.add(name)
                if errors:
                    continue  # consume the rest of the stream, copy nothing more
                try:
                    dst = params[name] if tensor.shape == params[name].shape else params[name][: tensor.shape[0]]
                    dst.copy_(tensor.to(device=self.device, dtype=self.dtype))
                except Exception as exc:  # noqa: BLE001 - reported below, after the stream is consumed
                    errors.append(f"{name}: copy failed ({type(exc).__name__}: {str(exc)[:200]})")
                    continue
                copied += 1
        missing = sorted(set(params) - seen)
        if errors or missing:
            if copied:
                self._version = -1
            raise ValueError(f"update_weights_full: {errors[:8]} missing names {missing[:8]}"
                             f"{' (engine weights are partly replaced: weight_version = -1)' if copied else ''}")
        self._version = version
        logger.info("embedded engine: loaded %d tensors, weight_version=%d", len(seen), version)

    def apply_sketch_delta(self, delta) -> int:
        """Validate and apply one sketch delta (``SketchDelta`` or its encoded bytes) to the
        engine's weights; returns the new ``weight_version``. Raises ``SyncError``: a rejection
        (checksum, version gap or replay, names, shapes, values, an allocation failing while the
        delta is staged) leaves the weights and the version untouched; a commit that fails after
        its first write (a kernel error) leaves ``weight_version = -1`` (unknown: every delta,
        the same one included, is refused until :meth:`update_weights_full` succeeds)."""
        from megatron_logra.sync.apply import ProjectionCache, stage_delta
        from megatron_logra.sync.engine import as_delta

        d = as_delta(delta)
        weights = {name: p.data for name, p in self.model.named_parameters()}
        if self._projections is None:
            self._projections = ProjectionCache()
        staged = stage_delta(weights, d, self._version, layout="hf", tp_size=1, tp_rank=0, cache=self._projections)
        try:
            self._version = staged.commit_()
        except BaseException:
            self._version = -1  # partly written: the delta must not be applied again on top of it
            raise
        return self._version

    def fingerprint(self, rows_per_tensor: int = 4) -> dict[str, str]:
        """Per-tensor hash of sampled rows (``megatron_logra.sync.fingerprint``) for drift checks, the rows
        salted with the engine's weight version (successive checks cover every row)."""
        from megatron_logra.sync import fingerprint

        rows = self.fingerprint_vocab_rows
        weights = {name: p.data[:rows] if rows is not None and name in VOCAB_PARALLEL else p.data
                   for name, p in self.model.named_parameters()}
        return fingerprint(weights, rows_per_tensor, salt=self._version)
