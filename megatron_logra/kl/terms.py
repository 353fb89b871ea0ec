"""The KL arithmetic of the probes: per-position KL terms of logits and their chunked global means.

Both probes (forward-mode, :mod:`megatron_logra.kl.probe`; finite-difference, :mod:`megatron_logra.kl.fd_probe`)
and the measured KL reduce logits the same way: ``½ Var_p(δz/τ)`` (the second-order predicted KL) or the exact
``KL(π_old ‖ π_new)``, per position in float64, with vocabulary-parallel logits reduced over the TP group, summed
in row chunks small enough for a large vocabulary, and averaged over the valid positions of every DP rank. This
module owns that arithmetic; how the logits and their tangents are produced stays with the probes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_logra.kl.controller import KLControlError
from megatron_logra.parallel import ParallelGroups, all_reduce_sum, group_size

__all__ = ["predicted_kl_terms", "exact_kl_terms", "CHUNK_BYTES", "chunk_rows", "mean_predicted"]


def _softmax_stats(z_NV: torch.Tensor, tp_group) -> tuple[torch.Tensor, torch.Tensor]:
    """Global (over the TP vocab shards) max and log-sum-exp of each row."""
    zmax = z_NV.max(dim=-1).values
    if group_size(tp_group) > 1:
        dist.all_reduce(zmax, op=dist.ReduceOp.MAX, group=tp_group)
    sumexp = torch.exp(z_NV - zmax[:, None]).sum(dim=-1)
    all_reduce_sum(sumexp, tp_group)
    return zmax, zmax + torch.log(sumexp)


def predicted_kl_terms(z_NV: torch.Tensor, dz_NV: torch.Tensor, temperature: float, tp_group=None) -> torch.Tensor:
    """Per-position ``½ Var_p(δz/τ)`` in float64 (``[N]``), vocab possibly sharded over TP."""
    z = z_NV.double() / temperature
    dz = dz_NV.double() / temperature
    _, lse = _softmax_stats(z, tp_group)
    p = torch.exp(z - lse[:, None])
    moments = torch.stack([(p * dz).sum(-1), (p * dz * dz).sum(-1)])
    all_reduce_sum(moments, tp_group)
    return 0.5 * (moments[1] - moments[0] ** 2).clamp_min(0.0)


def exact_kl_terms(old_NV: torch.Tensor, new_NV: torch.Tensor, temperature: float, tp_group=None) -> torch.Tensor:
    """Per-position ``KL(softmax(old/τ) ‖ softmax(new/τ))`` in float64 (``[N]``)."""
    zo = old_NV.double() / temperature
    zn = new_NV.double() / temperature
    _, lse_o = _softmax_stats(zo, tp_group)
    _, lse_n = _softmax_stats(zn, tp_group)
    logp_o = zo - lse_o[:, None]
    logp_n = zn - lse_n[:, None]
    kl = (torch.exp(logp_o) * (logp_o - logp_n)).sum(-1)
    all_reduce_sum(kl, tp_group)
    return kl


def _global_mean(total: torch.Tensor, count: torch.Tensor, dp_group) -> float:
    packed = torch.stack([total, count.double()])
    all_reduce_sum(packed, dp_group)
    if packed[1].item() <= 0:
        raise KLControlError("the KL probe has no valid positions")
    return (packed[0] / packed[1]).item()


CHUNK_BYTES = 64 << 20
"""Cap on one float64 ``[rows, V/tp]`` temporary of the KL terms (each chunk makes about six)."""


def chunk_rows(chunk: int, vocab_local: int) -> int:
    """Rows per chunk of the KL terms: at most ``chunk``, and few enough that one float64 row block
    stays within :data:`CHUNK_BYTES` (at a 152k vocabulary on one rank, 1024 rows would be 1.2 GB
    per temporary). The same on every TP rank (equal vocabulary shards), as the collectives need."""
    return max(1, min(chunk, CHUNK_BYTES // (8 * max(vocab_local, 1))))


def mean_predicted(z_NV: torch.Tensor, dz_NV: torch.Tensor, temperature: float, groups: ParallelGroups,
                    chunk: int) -> float:
    total = torch.zeros((), dtype=torch.float64, device=z_NV.device)
    chunk = chunk_rows(chunk, z_NV.shape[-1])
    for start in range(0, z_NV.shape[0], chunk):
        total += predicted_kl_terms(z_NV[start : start + chunk], dz_NV[start : start + chunk], temperature, groups.tp).sum()
    pred = _global_mean(total, torch.tensor(z_NV.shape[0], device=z_NV.device), groups.dp)
    if not torch.isfinite(torch.tensor(pred)):
        raise KLControlError(f"predicted KL is not finite ({pred})")
    return pred
