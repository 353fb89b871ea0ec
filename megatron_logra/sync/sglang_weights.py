"""What the sketch-delta loader reads from and records on a live SGLang model.

Contract: the engine-side view of the model's weights, for :mod:`~megatron_logra.sync.sglang_loader`:
its TP position (:func:`engine_tp`), its weight version (:func:`engine_version`), the weights
the loader may change (all parameters but its own state parameters), and each rank's share of
every Hugging Face tensor (:func:`engine_pieces`; at TP=1 also as whole views, :func:`engine_hf_view`).
Reads only, apart from the attributes the loader sets.

The engine's TP rank/size come from the ``tp_rank``/``tp_size`` attributes of SGLang's
parallel linear modules (or SGLang's parallel state, or 0/1); the weight version lives on the
model as ``model._logra_weight_version`` (0 at load). ``fingerprint`` hashes the weights in
Hugging Face layout (fused ``qkv_proj``/``gate_up_proj`` split back, vocab padding rows
dropped), so it compares with the trainer's fingerprint of its HF state: at any TP size each
rank's share of every HF tensor (:func:`engine_pieces`), whose sampled rows the ranks exchange
and assemble (:mod:`~megatron_logra.sync.sglang_fingerprint`). Engine side: imports only torch, the standard
library and the sync package (SGLang is optional).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional

import torch
from torch import nn

from megatron_logra.sync.codec import AttentionDims
from megatron_logra.sync.errors import SyncError
from megatron_logra.sync.layout import VOCAB_PARALLEL, sglang_gate_up_rows, sglang_qkv_rows
from megatron_logra.sync.sglang_wire import FINGERPRINT_PARAM, STATE_PARAM

__all__ = ["VERSION_ATTR", "VOCAB_PARALLEL", "Piece", "engine_tp", "engine_version", "engine_vocab_size",
           "engine_dtype", "engine_hf_view", "engine_pieces"]

VERSION_ATTR = "_logra_weight_version"
_ATTENTION_ATTR = "_logra_attention"
_OWN_PARAMS = (STATE_PARAM, FINGERPRINT_PARAM)


def engine_tp(model: nn.Module) -> tuple[int, int]:
    """``(tp_size, tp_rank)`` of this engine rank (module attributes, SGLang's state, or ``(1, 0)``).

    One position for the whole model: SGLang's data-parallel attention (``--dp-size > 1``), which splits
    attention and MLP over different TP groups, has none, and the client sends no deltas to it
    (:meth:`~megatron_logra.sync.sglang_primitives._SGLangPrimitives.check_delta_sync`)."""
    for module in model.modules():
        size, rank = getattr(module, "tp_size", None), getattr(module, "tp_rank", None)
        if isinstance(size, int) and isinstance(rank, int) and size >= 1:
            return size, rank
    try:  # pragma: no cover - only inside an SGLang worker
        from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        return int(get_tensor_model_parallel_world_size()), int(get_tensor_model_parallel_rank())
    except Exception:  # sglang missing or its parallel state not initialised
        return 1, 0


def engine_version(model: nn.Module) -> int:
    """Weight version recorded on ``model`` by this loader (0 before the first delta)."""
    return int(getattr(model, VERSION_ATTR, 0))


def engine_vocab_size(model: nn.Module) -> Optional[int]:
    """The vocabulary of the served model: ``model.config.vocab_size``, None when it cannot be told.

    It is SGLang's ``ModelConfig.vocab_size`` (``SamplingParams.verify`` refuses ``logit_bias`` keys
    outside ``[0, vocab_size)``) and the ``org_vocab_size`` of its ``VocabParallelEmbedding`` /
    ``ParallelLMHead`` (whose ``weight_loader`` asserts that a loaded tensor has exactly that many
    rows): rows past it are SGLang's own padding. Without a config, an unsharded model's
    ``embed_tokens.org_vocab_size`` says the same.
    """
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    org = getattr(embed, "org_vocab_size", None)
    if isinstance(org, int) and org > 0 and engine_tp(model)[0] == 1:
        return org
    return None


def engine_dtype(model: nn.Module) -> Optional[str]:
    """The dtype the engine's linear weights are held in (``"bfloat16"``, ...; the first 2-D floating
    parameter's), None when it has none: what sketch deltas merge into and refits are cast to. Bitwise
    agreement with the trainer, which the drift check compares, needs the trainer's ``model.params_dtype``."""
    for w in _own_weights(model).values():
        if w.dim() == 2 and w.is_floating_point():
            return str(w.dtype).removeprefix("torch.")
    return None


def _own_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.data for n, p in model.named_parameters() if n not in _OWN_PARAMS}


def _attention_dims(model: nn.Module) -> Optional[AttentionDims]:
    dims = getattr(model, _ATTENTION_ATTR, None)
    if dims is not None:
        return dims
    cfg = getattr(model, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return AttentionDims(heads, int(kv), int(d))


@torch.no_grad()
def engine_hf_view(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a TP=1 SGLang model under Hugging Face names (views, no copies): the
    :func:`engine_pieces` of an unsharded engine, each one block of whole rows.

    ``qkv_proj`` is split into ``q_proj``/``k_proj``/``v_proj`` (attention dims from the last
    delta, else ``model.config``), ``gate_up_proj`` into ``gate_proj``/``up_proj``, and the
    vocab-parallel ``embed_tokens``/``lm_head`` lose SGLang's padding rows. A tied ``lm_head`` is a
    shared parameter and appears once, as ``embed_tokens`` (as in the trainer's HF state). Raises
    ``SyncError("layout")`` when a fused weight does not fit.
    """
    size, _ = engine_tp(model)
    if size != 1:
        raise SyncError("layout", f"the HF view needs an unsharded engine, this one has TP={size}")
    out: dict[str, torch.Tensor] = {}
    for name, p in engine_pieces(model).items():  # the one statement of the engine layout
        n, l0 = p.local_rows.numel(), int(p.local_rows[0]) if p.local_rows.numel() else 0
        if not torch.equal(p.local_rows, _arange(l0, l0 + n)) or p.cols != (0, p.mat.shape[1]):
            raise SyncError("layout", f"{name}: not one block of whole rows on an unsharded engine")
        out[name] = p.mat[l0: l0 + n].reshape(p.shape)
    return out


# --------------------------------------------------------------------------- this rank's share of each HF tensor


@dataclass
class Piece:
    """This TP rank's share of one HF tensor: rows ``local_rows`` of ``mat`` are its rows ``rows``, columns ``cols``.

    ``cols = (c0, c1)``: ``mat`` holds columns ``[c0, c1)`` of the full (flattened) rows.

    Rows index dim 0 of the full tensor with the other dims flattened (as the fingerprint reads
    it); a tensor of rank <= 1 is one row of all its elements, so a bias shard is a column range
    of row 0. ``open_rows``: ``shape[0]`` is only where this rank's real rows end, the full row
    count is the largest any rank reports (vocab-parallel tensors without their padding rows).
    """

    shape: tuple[int, ...]
    rows: torch.Tensor
    local_rows: torch.Tensor
    cols: tuple[int, int]
    mat: torch.Tensor
    open_rows: bool = False


def _arange(lo: int, hi: int) -> torch.Tensor:
    return torch.arange(lo, hi, dtype=torch.int64)


def _whole(w: torch.Tensor) -> Piece:
    mat = w.reshape(1, -1) if w.dim() <= 1 else w.reshape(w.shape[0], -1)
    idx = _arange(0, mat.shape[0])
    return Piece(tuple(w.shape), idx, idx, (0, mat.shape[1]), mat)


def _fused(name: str, w: torch.Tensor, hf_idx: torch.Tensor, parts: dict[str, tuple[int, int]]) -> dict[str, Piece]:
    """Split a fused local parameter whose dim-0 entry ``i`` is entry ``hf_idx[i]`` of ``cat(parts)``."""
    if w.dim() < 1 or w.shape[0] != hf_idx.numel():
        raise SyncError("layout", f"{name}: {tuple(w.shape)} locally, the TP layout implies {hf_idx.numel()} rows")
    out: dict[str, Piece] = {}
    for part, (offset, size) in parts.items():
        local = torch.nonzero((hf_idx >= offset) & (hf_idx < offset + size)).reshape(-1)
        glob = hf_idx[local] - offset
        if w.dim() >= 2:
            out[part] = Piece((size, *w.shape[1:]), glob, local, (0, prod(w.shape[1:])), w.reshape(w.shape[0], -1))
            continue
        n = local.numel()  # a 1-D shard is a column range of the single row: it must be contiguous
        g0, l0 = (int(glob[0]), int(local[0])) if n else (0, 0)
        if not (torch.equal(glob, _arange(g0, g0 + n)) and torch.equal(local, _arange(l0, l0 + n))):
            raise SyncError("layout", f"{name}: this rank's {part} elements are not one contiguous block")
        out[part] = Piece((size,), _arange(0, 1), _arange(0, 1), (g0, g0 + n), w[l0: l0 + n].reshape(1, -1))
    return out


def _vocab_rows(module: nn.Module, local_rows: int, size: int, rank: int) -> tuple[int, int]:
    """``(first global row, real rows)`` of a vocab-parallel shard; local rows ``[0, real rows)`` are real.

    SGLang's ``VocabParallelEmbedding.shard_indices`` says it exactly (``org_vocab_start_index``/
    ``org_vocab_end_index``, padding removed). Without it, rank ``k`` starts at ``k·local_rows``
    of the padded vocabulary; ``org_vocab_size`` counts real rows: the whole vocabulary when it
    exceeds one shard (SGLang's meaning), else this shard's (the CPU stand-ins').
    """
    si = getattr(module, "shard_indices", None)
    lo, hi = getattr(si, "org_vocab_start_index", None), getattr(si, "org_vocab_end_index", None)
    if isinstance(lo, int) and isinstance(hi, int):
        if not 0 <= hi - lo <= local_rows:
            raise SyncError("layout", f"vocab shard [{lo}, {hi}) does not fit {local_rows} local rows")
        return lo, hi - lo
    start, org = rank * local_rows, getattr(module, "org_vocab_size", None)
    if not isinstance(org, int) or org <= 0:
        return start, local_rows
    return start, (max(0, min(local_rows, org - start)) if org > local_rows else org)


@torch.no_grad()
def engine_pieces(model: nn.Module) -> dict[str, Piece]:
    """Per HF name, this TP rank's :class:`Piece` of the full HF tensor (views of the engine weights).

    Layout (:mod:`megatron_logra.sync.layout`): ``qkv_proj`` rows are ``[q heads; kv heads; (v)]``
    of this rank (``sglang_qkv_rows``), ``gate_up_proj`` rows ``[gate; up]`` of this rank,
    ``o_proj``/``down_proj`` weights hold all rows and columns ``[k·C/T, (k+1)·C/T)``,
    ``embed_tokens``/``lm_head`` a block of vocabulary rows (padding dropped), the rest is
    replicated. A tied ``lm_head`` appears once, as ``embed_tokens``. Raises
    ``SyncError("layout")`` when a parameter does not fit the layout.
    """
    size, rank = engine_tp(model)
    dims = _attention_dims(model)
    out: dict[str, Piece] = {}
    for name, w in _own_weights(model).items():
        head, _, leaf = name.rpartition(".")
        module = head.rpartition(".")[2]
        pre = head[: len(head) - len(module)]
        if module == "qkv_proj":
            if dims is None:
                raise SyncError("layout", f"{name}: attention dims unknown (no delta yet and no model.config)")
            q, kv = dims.num_heads * dims.head_dim, dims.num_kv_heads * dims.head_dim
            parts = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
            pieces = _fused(name, w, sglang_qkv_rows(dims, size, rank)[1], parts)
            out.update({f"{pre}{p}_proj.{leaf}": piece for p, piece in pieces.items()})
        elif module == "gate_up_proj":
            if w.dim() < 1 or w.shape[0] % 2:
                raise SyncError("layout", f"{name}: {tuple(w.shape)} is not [gate; up]")
            f = size * w.shape[0] // 2
            pieces = _fused(name, w, sglang_gate_up_rows(2 * f, size, rank), {"gate": (0, f), "up": (f, f)})
            out.update({f"{pre}{p}_proj.{leaf}": piece for p, piece in pieces.items()})
        elif module in ("o_proj", "down_proj") and leaf == "weight" and w.dim() == 2:
            c = w.shape[1]
            rows = _arange(0, w.shape[0])
            out[name] = Piece((w.shape[0], size * c), rows, rows, (rank * c, (rank + 1) * c), w)
        elif name in VOCAB_PARALLEL and w.dim() >= 1:
            start, n = _vocab_rows(model.get_submodule(head), w.shape[0], size, rank)
            out[name] = Piece((start + n, *w.shape[1:]), _arange(start, start + n), _arange(0, n),
                              (0, prod(w.shape[1:])), w.reshape(w.shape[0], -1), open_rows=True)
        else:
            out[name] = _whole(w)
    return out
