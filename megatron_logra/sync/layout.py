"""Map a sketch delta (Megatron row order, TP=1) onto an engine's own parameters.

The wire carries, per canonical target, the full ``U_OR`` in Megatron row order. An engine
needs, for each of *its* parameters, the rows of ``U`` it holds and the columns of ``A``
it multiplies (``A`` is regenerated from the canonical name, so every piece of one layer
shares it). Everything here is row selection (``index_select``: bitwise copies) or a
column range; no arithmetic.

Megatron order (see :mod:`megatron_logra.models.hf`): fused QKV rows are interleaved per
query group ``g``: ``[q heads of g (H/G·d rows); k_g (d); v_g (d)]``; ``linear_fc1`` rows
are ``[gate; up]``. The row index maps of these orders live in :mod:`megatron_logra.sync.row_maps`.

Layouts:

* ``hf`` (Hugging Face, TP=1): ``q_proj``/``k_proj``/``v_proj`` (head-major rows),
  ``gate_proj``/``up_proj``, ``o_proj``, ``down_proj``; dense tensors keep their HF names.
* ``sglang`` (fused, TP ``k`` of ``T``): ``qkv_proj`` holds ``[q heads of rank k; kv heads of
  rank k (k); (v)]`` (a kv head is replicated when ``G < T``), ``gate_up_proj`` holds
  ``[gate rows of k; up rows of k]`` (column parallel: a subset of U's rows, all of A);
  ``o_proj``/``down_proj`` are row parallel: all of U, columns ``[k·n/T, (k+1)·n/T)`` of A.
  Dense q/k/v (gate/up) weights and biases -- trained non-targets, e.g. attention with
  ``logra.targets=linear_fc1,linear_fc2`` -- are fused and sharded the same way (all three,
  both, must be present); dense ``o_proj``/``down_proj`` weights are cut to columns
  ``[k·n/T, (k+1)·n/T)``; ``embed_tokens`` and ``lm_head`` are vocab parallel (rows of rank k,
  padding rows untouched); other dense tensors (norms, o/down biases) are replicated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_logra.sync.codec import SketchDelta
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.row_maps import megatron_rows_from_hf, qkv_rows_hf, sglang_gate_up_rows, sglang_qkv_rows

logger = logging.getLogger(__name__)

__all__ = [
    "VOCAB_PARALLEL",
    "EngineFactor", "DenseEntry", "EnginePlan", "LAYOUT_NAMES",
    "qkv_rows_hf", "megatron_rows_from_hf", "sglang_qkv_rows", "sglang_gate_up_rows", "plan_for",
]

LAYOUT_NAMES = ("hf", "sglang")
VOCAB_PARALLEL = ("model.embed_tokens.weight", "lm_head.weight")
"""HF names of the vocab-parallel tensors (one row per vocabulary id)."""


@dataclass
class EngineFactor:
    """One engine parameter's share of a target update: ``W_param ← decay·W − U_OR·A[:, cols]``."""

    param: str
    """Engine parameter name (``model.layers.0.self_attn.q_proj.weight`` ...)."""
    target: str
    """Canonical target name (keys the projection)."""
    U_OR: torch.Tensor
    """bf16 ``[rows of this parameter, r]``."""
    n_in: int
    """Full input width of the layer."""
    cols: Optional[range]
    """Columns of ``A`` this parameter multiplies (row-parallel shard), None for all."""
    rows: Optional[torch.Tensor] = None
    """The rows of the target's canonical ``U`` (TP=1 Megatron order) this parameter's rows are, in
    order; None: all of them. They key the stochastic rounding of a bf16 merge."""


@dataclass
class DenseEntry:
    """A dense tensor for one engine parameter; ``split="vocab"`` takes this rank's row block."""

    param: str
    tensor: torch.Tensor
    split: str = "none"


@dataclass
class EnginePlan:
    """Everything one engine rank applies for a delta."""

    factors: list[EngineFactor]
    dense: list[DenseEntry]


def _prefix(name: str, suffix: str) -> str:
    return name[: -len(suffix)]


def _hf_factors(delta: SketchDelta) -> list[EngineFactor]:
    out: list[EngineFactor] = []
    for t in delta.targets:
        if t.layout == "qkv_interleaved":
            pre = _prefix(t.name, "qkv_proj")
            for part, rows in qkv_rows_hf(delta.attention).items():  # type: ignore[arg-type]
                out.append(EngineFactor(f"{pre}{part}_proj.weight", t.name, t.U_OR.index_select(0, rows), t.n_in, None,
                                        rows))
        elif t.layout == "gate_up":
            pre = _prefix(t.name, "gate_up_proj")
            gate, up = t.U_OR.chunk(2, dim=0)
            half = gate.shape[0]
            out.append(EngineFactor(f"{pre}gate_proj.weight", t.name, gate, t.n_in, None, torch.arange(half)))
            out.append(EngineFactor(f"{pre}up_proj.weight", t.name, up, t.n_in, None,
                                    torch.arange(half, half + up.shape[0])))
        else:
            out.append(EngineFactor(f"{t.name}.weight", t.name, t.U_OR, t.n_in, None))
    return out


def _sglang_factors(delta: SketchDelta, tp_size: int, tp_rank: int) -> list[EngineFactor]:
    out: list[EngineFactor] = []
    for t in delta.targets:
        param = f"{t.name}.weight"
        if t.layout == "qkv_interleaved":
            meg_rows, _ = sglang_qkv_rows(delta.attention, tp_size, tp_rank)  # type: ignore[arg-type]
            out.append(EngineFactor(param, t.name, t.U_OR.index_select(0, meg_rows), t.n_in, None, meg_rows))
        elif t.layout == "gate_up":
            rows = sglang_gate_up_rows(t.U_OR.shape[0], tp_size, tp_rank)
            out.append(EngineFactor(param, t.name, t.U_OR.index_select(0, rows), t.n_in, None, rows))
        elif t.layout == "row_parallel" and tp_size > 1:
            if t.n_in % tp_size:
                raise SyncError("layout", f"{t.name}: n_in={t.n_in} is not divisible by the engine TP size {tp_size}")
            per = t.n_in // tp_size
            out.append(EngineFactor(param, t.name, t.U_OR, t.n_in, range(tp_rank * per, (tp_rank + 1) * per)))
        else:
            out.append(EngineFactor(param, t.name, t.U_OR, t.n_in, None))
    return out


_ROW_PARALLEL_WEIGHTS = (".o_proj.weight", ".down_proj.weight")


def _fusable(fused_name: str, parts: list[str], tensors: list[torch.Tensor]) -> None:
    """Raise ``SyncError("shape")`` unless ``tensors`` can be stacked along their rows: each at least 1-D,
    all of one rank and the same trailing dimensions (a weight ``[rows, n_in]``, a bias ``[rows]``)."""
    first = tensors[0]
    for name, t in zip(parts, tensors):
        if t.dim() < 1 or t.dim() != first.dim() or tuple(t.shape[1:]) != tuple(first.shape[1:]):
            shapes = {p.rsplit(".", 2)[-2]: tuple(x.shape) for p, x in zip(parts, tensors)}
            raise SyncError("shape", f"fusing {fused_name}: the parts do not stack along their rows "
                                     f"(at {name}): {shapes}")


def _sglang_dense(delta: SketchDelta, tp_size: int, tp_rank: int) -> list[DenseEntry]:
    """This rank's dense entries: q/k/v and gate/up (weights and biases) fused into ``qkv_proj`` /
    ``gate_up_proj`` rows of this rank, ``o_proj``/``down_proj`` weights cut to this rank's
    columns, ``embed_tokens``/``lm_head`` vocab parallel, everything else whole (replicated)."""
    dense = dict(delta.dense)
    out: list[DenseEntry] = []
    for name in sorted(dense):
        leaf = name.rpartition(".")[2]  # weight / bias
        if name.endswith(".q_proj." + leaf):
            pre = _prefix(name, f"q_proj.{leaf}")
            fused_name = f"{pre}qkv_proj.{leaf}"
            parts = [f"{pre}{p}_proj.{leaf}" for p in "qkv"]
            missing = [p for p in parts if p not in dense]
            if missing:
                raise SyncError("keys", f"fusing {fused_name} needs {missing}")
            if delta.attention is None:
                raise SyncError("layout", f"fusing {fused_name} needs attention dims in the header")
            _, hf_rows = sglang_qkv_rows(delta.attention, tp_size, tp_rank)
            _fusable(fused_name, parts, [dense[p] for p in parts])
            both = torch.cat([dense[p] for p in parts])
            dims = delta.attention
            want = (dims.num_heads + 2 * dims.num_kv_heads) * dims.head_dim
            if both.shape[0] != want:
                raise SyncError("shape", f"fusing {fused_name}: q/k/v hold {both.shape[0]} rows, the attention dims "
                                         f"{dims} imply {want}")
            out.append(DenseEntry(fused_name, both.index_select(0, hf_rows)))
        elif name.endswith((".k_proj." + leaf, ".v_proj." + leaf)):
            q_name = name.rsplit(".", 2)[0] + f".q_proj.{leaf}"
            if q_name not in dense:
                raise SyncError("keys", f"dense {name} present without its {q_name.rsplit('.', 2)[-2]}.{leaf}")
        elif name.endswith(".gate_proj." + leaf):
            pre = _prefix(name, f"gate_proj.{leaf}")
            fused_name = f"{pre}gate_up_proj.{leaf}"
            if f"{pre}up_proj.{leaf}" not in dense:
                raise SyncError("keys", f"fusing {fused_name} needs {pre}up_proj.{leaf}")
            gate, up = dense[name], dense[f"{pre}up_proj.{leaf}"]
            if gate.dim() < 1 or gate.shape != up.shape:
                raise SyncError("shape", f"fusing {fused_name}: gate {tuple(gate.shape)} vs up {tuple(up.shape)} "
                                         "(both need the same shape, at least 1-D)")
            both = torch.cat([gate, up])
            rows = sglang_gate_up_rows(both.shape[0], tp_size, tp_rank)
            out.append(DenseEntry(fused_name, both.index_select(0, rows)))
        elif name.endswith(".up_proj." + leaf):
            if f"{_prefix(name, f'up_proj.{leaf}')}gate_proj.{leaf}" not in dense:
                raise SyncError("keys", f"dense {name} present without its gate_proj.{leaf}")
        elif name.endswith(_ROW_PARALLEL_WEIGHTS) and tp_size > 1:  # row parallel: this rank's input columns
            w = dense[name]
            if w.dim() != 2 or w.shape[1] % tp_size:
                raise SyncError("layout", f"dense {name} {tuple(w.shape)}: its columns do not split over the engine "
                                          f"TP size {tp_size}")
            per = w.shape[1] // tp_size
            out.append(DenseEntry(name, w[:, tp_rank * per: (tp_rank + 1) * per]))
        elif name in VOCAB_PARALLEL:
            out.append(DenseEntry(name, dense[name], split="vocab"))  # SGLang pads the vocabulary even at TP 1
        else:
            out.append(DenseEntry(name, dense[name]))
    return out


def plan_for(delta: SketchDelta, layout: str = "hf", tp_size: int = 1, tp_rank: int = 0) -> EnginePlan:
    """The engine parameters ``delta`` touches on rank ``tp_rank`` of a ``tp_size`` engine in ``layout``.

    Raises :class:`SyncError` (``layout``) for an unknown layout, an HF engine with TP > 1, or
    dimensions the engine TP size does not divide; (``keys``/``shape``) for dense q/k/v or gate/up
    entries the sglang layout cannot fuse (a part missing, parts that do not stack along their rows).
    """
    if layout not in LAYOUT_NAMES:
        raise SyncError("layout", f"unknown engine layout {layout!r}; choose one of {LAYOUT_NAMES}")
    if tp_size < 1 or not (0 <= tp_rank < tp_size):
        raise SyncError("layout", f"engine tp_rank={tp_rank} is not in [0, tp_size={tp_size})")
    if any(t.layout == "qkv_interleaved" for t in delta.targets) and delta.attention is None:
        raise SyncError("layout", "delta has a fused QKV target but no attention dims")
    if layout == "hf":
        if tp_size != 1:
            raise SyncError("layout", f"the hf layout is unsharded; got tp_size={tp_size}")
        return EnginePlan(_hf_factors(delta), dense_for(delta, layout, tp_size, tp_rank))
    return EnginePlan(_sglang_factors(delta, tp_size, tp_rank), dense_for(delta, layout, tp_size, tp_rank))


def dense_for(delta: SketchDelta, layout: str = "hf", tp_size: int = 1, tp_rank: int = 0) -> list[DenseEntry]:
    """The dense part of :func:`plan_for` alone (an engine that kept the factor part of an earlier plan of the
    same structure maps only this). Same errors as :func:`plan_for` for the dense entries."""
    if layout == "hf":
        return [DenseEntry(k, v) for k, v in sorted(delta.dense.items())]
    return _sglang_dense(delta, tp_size, tp_rank)
