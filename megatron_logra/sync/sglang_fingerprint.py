"""The fingerprint of a TP-sharded SGLang engine, equal to the TP=1 fingerprint of the full HF tensors.

Each TP rank holds a :class:`~megatron_logra.sync.sglang_weights.Piece` of every HF tensor
(:func:`~megatron_logra.sync.sglang_weights.engine_pieces`). The ranks exchange, over SGLang's
TP CPU group (``all_gather_object``, two rounds of small objects):

1. what each holds (full shape, dtype): the agreed full shape fixes the sampled rows
   (:func:`~megatron_logra.sync.fingerprint.sampled_rows_of`; a vocab-parallel tensor has as
   many rows as the rank whose real rows end last says);
2. the raw bits of its share of those sampled rows. Every rank assembles every sampled row and
   hashes it with :func:`~megatron_logra.sync.fingerprint.digest`, so all ranks write the same
   record and it equals ``fingerprint(full_hf_weights, salt=salt)`` whatever the TP size (the
   loader salts with the engine's weight version, so each version samples its own rows).

An element held by several ranks (replicated kv heads, norms) must be bitwise equal on all of
them: otherwise that tensor's digest is prefixed ``replica-mismatch:`` so it differs from the
trainer's and the drift check flags it. An element of a sampled row that no rank holds, or
ranks that disagree on names, shapes or dtypes, raise ``SyncError("layout")`` -- on every rank,
since every rank sees the same exchanged data (a rank that fails locally sends its error
instead of its share, so no rank is left waiting in a collective). Engine side: imports only
torch, the standard library and the sync package.
"""

from __future__ import annotations

from math import prod
from typing import Any, Callable, Mapping, Optional

import torch
from torch import nn

from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.fingerprint import digest, sampled_rows_of
from megatron_logra.sync.sglang_weights import Piece, engine_pieces, engine_tp

__all__ = ["MISMATCH_PREFIX", "sharded_fingerprint", "engine_fingerprint"]

MISMATCH_PREFIX = "replica-mismatch:"
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the CPU as integers of its element size (bitwise compare, NaN-safe, same bytes)."""
    return t.detach().cpu().view(_INT_OF_SIZE[t.element_size()])


def _gatherer(group: Any, tp_size: int) -> Callable[[Any], list]:
    if group is None:
        if tp_size > 1:
            raise SyncError("layout", f"fingerprinting a TP={tp_size} engine needs its TP CPU group; none was found")
        return lambda obj: [obj]

    def gather(obj: Any) -> list:
        out: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(out, obj, group=group)
        return out

    return gather


def _round(gather: Callable[[Any], list], build: Callable[[], Any], what: str) -> list:
    """Every rank's ``build()``; raises the same ``SyncError`` on every rank if any rank's failed."""
    try:
        mine: tuple = ("ok", build())
    except Exception as exc:
        mine = ("error", str(exc) if isinstance(exc, SyncError) else repr(exc))
    got = gather(mine)
    errors = [f"TP rank {r}: {msg}" for r, (status, msg) in enumerate(got) if status != "ok"]
    if errors:
        raise SyncError("layout", f"{what} failed on {len(errors)} rank(s): {'; '.join(errors)}")
    return [payload for _, payload in got]


def _agree(metas: list[dict[str, tuple]]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The full shape and dtype of each HF tensor, from every rank's ``{name: (shape, dtype, open_rows)}``."""
    names = set(metas[0])
    if any(set(m) != names for m in metas):
        raise SyncError("layout", "TP ranks list different HF tensors")
    out = {}
    for name in sorted(names):
        shapes = [m[name][0] for m in metas]
        dtypes = {m[name][1] for m in metas}
        if len(dtypes) != 1:
            raise SyncError("layout", f"{name}: TP ranks hold dtypes {sorted(map(str, dtypes))}")
        if metas[0][name][2]:  # open rows: the full row count is the largest real-row end
            if len({s[1:] for s in shapes}) != 1:
                raise SyncError("layout", f"{name}: TP ranks report shapes {shapes}")
            shape = (max(s[0] for s in shapes), *shapes[0][1:])
        elif len(set(shapes)) != 1:
            raise SyncError("layout", f"{name}: TP ranks report full shapes {shapes}")
        else:
            shape = shapes[0]
        out[name] = (shape, dtypes.pop())
    return out


def _share(piece: Piece, rows: list[int]) -> tuple[torch.Tensor, tuple[int, int], torch.Tensor]:
    """``(positions in rows, column range, bits [n, cols])`` of the sampled rows this piece holds."""
    want = torch.tensor(rows, dtype=torch.int64)
    hit = torch.nonzero(piece.rows.reshape(-1, 1) == want.reshape(1, -1))  # (local index, position) pairs
    local = piece.local_rows[hit[:, 0]].to(piece.mat.device)
    return hit[:, 1].clone(), piece.cols, _bits(piece.mat.index_select(0, local))


def _assemble(name: str, shape: tuple[int, ...], dtype: torch.dtype, rows: list[int], shares: list,
              salt: Optional[int] = None) -> str:
    width = prod(shape[1:]) if len(shape) > 1 else prod(shape)
    out = torch.zeros(len(rows), width, dtype=_INT_OF_SIZE[torch.empty((), dtype=dtype).element_size()])
    have = torch.zeros(len(rows), width, dtype=torch.bool)
    mismatch = False
    for pos, (c0, c1), bits in shares:
        if not (0 <= c0 <= c1 <= width) or tuple(bits.shape) != (pos.numel(), c1 - c0) or bits.dtype != out.dtype:
            raise SyncError("layout", f"{name}: a TP rank sent columns [{c0}, {c1}) {tuple(bits.shape)} "
                                      f"of a row of {width}")
        if not pos.numel():
            continue
        seen, old = have[pos, c0:c1], out[pos, c0:c1]
        mismatch = mismatch or bool((seen & (old != bits)).any())
        out[pos, c0:c1] = torch.where(seen, old, bits)
        have[pos, c0:c1] = True
    if not bool(have.all()):
        raise SyncError("layout", f"{name}: {int((~have).sum())} elements of the sampled rows are held by no TP rank")
    return (MISMATCH_PREFIX if mismatch else "") + digest(name, dtype, shape, rows, out, salt)


@torch.no_grad()
def sharded_fingerprint(build: Callable[[], Mapping[str, Piece]], group: Any = None, tp_size: int = 1,
                        rows_per_tensor: int = 4, salt: Optional[int] = None) -> dict[str, str]:
    """HF name -> digest of the full tensor, assembled from every rank's pieces (``build()`` on each rank).

    Collective over ``group`` (None: a single rank, ``tp_size`` must be 1). Equal on every rank,
    and equal to :func:`~megatron_logra.sync.fingerprint.fingerprint` of the full tensors with the
    same ``salt`` when the replicas agree (see module docstring). ``salt`` must be the same on every
    rank (the weight version: successive versions sweep every row).
    """
    gather = _gatherer(group, tp_size)
    held: dict[str, Piece] = {}

    def describe() -> dict[str, tuple]:
        held.update(build())
        return {n: (tuple(int(x) for x in p.shape), p.mat.dtype, p.open_rows) for n, p in held.items()}

    full = _agree(_round(gather, describe, "listing the engine's HF pieces"))
    sampled = {n: sampled_rows_of(n, shape, rows_per_tensor, salt) for n, (shape, _) in full.items()}
    shares = _round(gather, lambda: {n: _share(p, sampled[n]) for n, p in held.items()}, "sampling rows")
    return {n: _assemble(n, shape, dtype, sampled[n], [s[n] for s in shares], salt)
            for n, (shape, dtype) in full.items()}


def engine_fingerprint(model: nn.Module, group: Optional[Any] = None, rows_per_tensor: int = 4,
                       salt: Optional[int] = None) -> dict[str, str]:
    """The fingerprint of SGLang ``model`` in HF layout at any TP size; collective over ``group`` (its TP CPU group).
    ``salt``: see :func:`sharded_fingerprint` (pass the engine's weight version, ``engine_version(model)``,
    so successive checks sweep every row; None samples the same rows at every version)."""
    return sharded_fingerprint(lambda: engine_pieces(model), group, engine_tp(model)[0], rows_per_tensor, salt)
