"""The structure-free checks of a sketch delta against an engine's weights, under :mod:`megatron_logra.sync.apply`.

Contract: each function only reads (the delta, the engine's weights) and raises
:class:`~megatron_logra.sync.errors.SyncError` naming the first problem: :func:`check_version` the
version chain (``replay``, ``gap``, ``version``), :func:`_require` missing engine parameters
(``name``), :func:`_check_dense` the dense entries (shape, this rank's vocab row block, finiteness,
no two entries on one engine parameter); :func:`_first_nonfinite` / :func:`_finite` are the
one-pass NaN/inf tests (min/max, NaN propagates) the factors and dense tensors go through. The
layout mapping and the per-weight checks of the factors stay in :mod:`megatron_logra.sync.apply`
(``validate``), which runs these; ``check_version`` is re-exported there.
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import DenseEntry

__all__ = ["check_version"]


def check_version(delta: SketchDelta, current_version: int) -> None:
    """Raise :class:`SyncError` unless ``delta.base_version == current_version``.

    ``new_version <= current``: replay (``replay``); ``base > current``: missing deltas
    (``gap``); otherwise the base diverged from the engine (``version``).
    """
    if delta.base_version == current_version:
        return
    if delta.new_version <= current_version:
        raise SyncError("replay", f"delta {delta.base_version}->{delta.new_version} is already applied (engine at {current_version})")
    if delta.base_version > current_version:
        raise SyncError("gap", f"delta {delta.base_version}->{delta.new_version} skips versions: engine is at {current_version}")
    raise SyncError("version", f"delta base {delta.base_version} != engine version {current_version}")


def _first_nonfinite(tensors: list[torch.Tensor]) -> Optional[int]:
    """Index of the first tensor holding a NaN or inf, or None: min/max of each (NaN propagates), read
    back once per device rather than once per tensor."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.is_floating_point() and t.numel():
            by_device.setdefault(t.device, []).append(i)
    bad = []
    for idx in by_device.values():
        ends = torch.stack([torch.stack(torch.aminmax(tensors[i])).float() for i in idx])
        finite = torch.isfinite(ends).all(dim=1).tolist()
        bad += [i for i, ok in zip(idx, finite) if not ok]
    return min(bad) if bad else None


def _finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: one min/max pass (NaN propagates through both; a third of ``isfinite``'s work)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _require(params: list[str], weights: dict[str, torch.Tensor]) -> None:
    """Raise ``SyncError("name")`` naming the first few of ``params`` the engine does not have."""
    missing = [p for p in params if p not in weights]
    if missing:
        raise SyncError("name", f"engine has no parameters {missing[:6]}{'...' if len(missing) > 6 else ''}")


def _check_dense(dense: list[DenseEntry], factor_params: list[str], weights: dict[str, torch.Tensor],
                 tp_size: int) -> None:
    """The dense entries' checks of :func:`validate` (and that no two entries share an engine parameter)."""
    _require(sorted({d.param for d in dense}), weights)
    for d in dense:
        w = weights[d.param]
        if d.split == "vocab":  # row blocks: both sides need a row dimension
            ok = w.dim() >= 1 and d.tensor.dim() == w.dim()
            if ok:
                rows = w.shape[0] * tp_size
                ok = tuple(w.shape[1:]) == tuple(d.tensor.shape[1:]) and rows >= d.tensor.shape[0] > rows - w.shape[0]
        else:  # the whole tensor (any rank, 0-d included)
            ok = tuple(w.shape) == tuple(d.tensor.shape)
        if not ok:
            raise SyncError("shape", f"dense {d.param}: engine {tuple(w.shape)} vs delta {tuple(d.tensor.shape)} (split={d.split})")
        if not _finite(d.tensor):
            raise SyncError("nonfinite", f"dense {d.param} has non-finite entries")
    params = factor_params + [d.param for d in dense]
    if len(set(params)) != len(params):
        raise SyncError("name", "delta maps two entries onto one engine parameter")
