"""Row index maps between Megatron's fused row orders and an engine's: the QKV interleave and ``[gate; up]``.

Megatron's fused QKV rows are interleaved per query group ``g``: ``[q heads of g (H/G·d rows); k_g (d); v_g (d)]``;
``linear_fc1`` rows are ``[gate; up]``. :func:`qkv_rows_hf` and :func:`megatron_rows_from_hf` map them to and from
Hugging Face's head-major ``q`` / ``k`` / ``v``; :func:`sglang_qkv_rows` and :func:`sglang_gate_up_rows` give the rows
a TP rank of SGLang holds in its fused ``qkv_proj`` / ``gate_up_proj`` (a kv head is replicated when ``G < T``). Only
``int64`` index tensors: the callers select rows with them (bitwise copies); a layout an engine's TP size cannot
split is ``SyncError("layout")``. Importable from :mod:`megatron_logra.sync.layout`.
"""

from __future__ import annotations

import functools

import torch

from megatron_logra.sync.codec import AttentionDims
from megatron_logra.sync.errors import SyncError

__all__ = ["megatron_rows_from_hf", "qkv_rows_hf", "sglang_gate_up_rows", "sglang_qkv_rows"]


@functools.lru_cache(maxsize=64)
def qkv_rows_hf(dims: AttentionDims) -> dict[str, torch.Tensor]:
    """Indices into the Megatron-interleaved QKV rows of HF ``q``, ``k`` and ``v`` rows (in HF order).

    Memoised per ``dims`` (every sync maps every layer): the tensors are shared, read them only.

    Megatron row of (group ``g``, slot ``s`` in ``[0, H/G+2)``, row ``t`` in ``[0, d)``) is
    ``(g·(H/G+2) + s)·d + t``; HF query head ``h = g·H/G + j`` is slot ``j`` of group ``g``,
    ``k_g`` is slot ``H/G``, ``v_g`` slot ``H/G + 1``.
    """
    H, G, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    per = H // G
    base = torch.arange(G * (per + 2) * d, dtype=torch.int64).reshape(G, per + 2, d)
    return {
        "q": base[:, :per].reshape(H * d).clone(),
        "k": base[:, per].reshape(G * d).clone(),
        "v": base[:, per + 1].reshape(G * d).clone(),
    }


def megatron_rows_from_hf(dims: AttentionDims) -> torch.Tensor:
    """Inverse permutation: index into ``cat([q; k; v])`` (HF order) of each Megatron QKV row."""
    parts = qkv_rows_hf(dims)
    hf_of_megatron = torch.cat([parts["q"], parts["k"], parts["v"]])
    inv = torch.empty_like(hf_of_megatron)
    inv[hf_of_megatron] = torch.arange(hf_of_megatron.numel(), dtype=torch.int64)
    return inv


def _kv_shard(G: int, tp_size: int, tp_rank: int) -> range:
    """KV heads held by ``tp_rank`` (SGLang/vLLM QKVParallelLinear: replicated when ``G < T``)."""
    if G >= tp_size:
        if G % tp_size:
            raise SyncError("layout", f"num_kv_heads={G} is not divisible by the engine TP size {tp_size}")
        n = G // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    if tp_size % G:
        raise SyncError("layout", f"engine TP size {tp_size} is not a multiple of num_kv_heads={G}")
    head = tp_rank // (tp_size // G)
    return range(head, head + 1)


def sglang_qkv_rows(dims: AttentionDims, tp_size: int, tp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(megatron_rows, hf_rows)`` of the local fused ``qkv_proj`` of ``tp_rank``.

    ``megatron_rows`` index the Megatron-interleaved U; ``hf_rows`` index ``cat([q; k; v])``
    in HF order (for fusing q/k/v biases). Local order: ``[q heads; k heads; v heads]``.
    """
    H, G, d = dims.num_heads, dims.num_kv_heads, dims.head_dim
    if H % tp_size:
        raise SyncError("layout", f"num_heads={H} is not divisible by the engine TP size {tp_size}")
    hq = H // tp_size
    q_heads = range(tp_rank * hq, (tp_rank + 1) * hq)
    kv = _kv_shard(G, tp_size, tp_rank)

    def rows(heads: range, offset: int) -> torch.Tensor:
        return torch.arange(heads.start * d, heads.stop * d, dtype=torch.int64) + offset

    hf_rows = torch.cat([rows(q_heads, 0), rows(kv, H * d), rows(kv, H * d + G * d)])
    parts = qkv_rows_hf(dims)
    hf_to_meg = torch.cat([parts["q"], parts["k"], parts["v"]])
    return hf_to_meg[hf_rows], hf_rows


def sglang_gate_up_rows(n_out: int, tp_size: int, tp_rank: int) -> torch.Tensor:
    """Rows of ``[gate; up]`` (``n_out = 2f``) held by ``tp_rank``: ``[gate block; up block]``."""
    f = n_out // 2
    if f % tp_size:
        raise SyncError("layout", f"ffn size {f} is not divisible by the engine TP size {tp_size}")
    per = f // tp_size
    g = torch.arange(tp_rank * per, (tp_rank + 1) * per, dtype=torch.int64)
    return torch.cat([g, g + f])
